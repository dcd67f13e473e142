set -u
R=/root/res/b1; mkdir -p $R
E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
F="--rounds 2 --check-coverage --num-gpus 1 $E"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > $R/nvidia-smi.txt 2>&1
STAGGER_S=12 bash scripts/gpu_parallel.sh $R/par par 420 \
 "fam-tiny|benchmark.py --model tiny $F" \
 "fam-qwen2|benchmark.py --model tiny-qwen2-moe $F" \
 "fam-mixtral|benchmark.py --model tiny-mixtral $F" \
 "fam-dsv3|benchmark.py --model tiny-deepseek-v3 $F" \
 "fam-glm4|benchmark.py --model tiny-glm4-moe $F" \
 "fam-qwen3|benchmark.py --model tiny-qwen3 $F" \
 "fam-gptoss|benchmark.py --model tiny-gpt-oss --loaders vllm $F" \
 "dsv3-train|rlhf_ipc_fsdp_ep.py --model tiny-deepseek-v3 --num-gpus 1 --train --rounds 5 --check-coverage $E" \
 "tiny-train|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --train --rounds 5 $E" \
 "stale|scripts/with_worker.py stale_block_worker.StaleBlockWorker --model tiny --num-gpus 1 --train --lr 1e-3 --rounds 3 $E" > $R/par.txt 2>&1
touch $R/HALF
stamp() { while IFS= read -r l; do printf '%(%H:%M:%S)T %s\n' -1 "$l"; done; }
mkdir -p $R/seq
run() {  # name program flags...
  n=$1; shift; s=$(date +%s)
  timeout -s INT -k 30 420 python3 "$@" --server-log $R/seq/$n.server.log 2>&1 | stamp > $R/seq/$n.out
  echo "=== $n rc=${PIPESTATUS[0]} after $(( $(date +%s) - s ))s: $*" >> $R/seq.txt
  grep -E "^\S+ \[(gate|exact|server\] healthy|sleep\]|send\]|wake_kv\])|FAILED|rror" $R/seq/$n.out | grep -v "\.\.\.$" | tail -40 >> $R/seq.txt
  echo "leftover: $(pgrep -fc 'vllm.entrypoints|EngineCore' || true)" >> $R/seq.txt
}
run tiny-a rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rounds 5 --json $R/seq/tiny-a.json
run tiny-b rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rounds 5 --json $R/seq/tiny-b.json
run tiny-train rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --train --rounds 5 --json $R/seq/tiny-train.json
touch $R/SEQ3
run moon benchmark.py --model moonlight-16b-a3b-shape --num-gpus 1 --rounds 5 --loaders direct --out $R/seq/moon.json
touch $R/DONE
