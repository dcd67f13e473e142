# vLLM 0.34.0 on one H200, the round's proof outside the round (RoundProof): run from the repository's root on
# the GPU machine, with the bundle of shared/gpu-host/wheels-vllm-0.34.txt installed; results under $1.
#   bash batch1.sh OUT
# Side by side: the Moonlight-16B-A3B shape (compiled), the direct loader beside vLLM's loader in its in-place
# reload (VLLM_RELOAD_MODE=direct), 5 syncs each, then both bit for bit; small servers (eager but tiny-5): the
# README's tiny command with 5 rounds (compiled), two experts swapped on the way into vLLM's loader (must exit 1),
# tiny-deepseek-v3 and tiny-mixtral in FP8 with --train, tiny through both loaders with --check-coverage; and the
# Moonlight shape written to disk as a checkpoint (batch2.sh reads it).
set -u
R=${1:?OUT}; mkdir -p "$R"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$R/nvidia-smi.txt" 2>&1
python3 -c "import vllm, torch, transformers, huggingface_hub as h; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| huggingface_hub', h.__version__)" >> "$R/nvidia-smi.txt" 2>&1
git log -1 --format='commit %H' >> "$R/nvidia-smi.txt" 2>/dev/null
(python3 scripts/write_shape_checkpoint.py moonlight-16b-a3b-shape /root/ckpt-moonlight > "$R/checkpoint-write.txt" 2>&1
 echo "rc=$?" >> "$R/checkpoint-write.txt") &
# --kv-cache-memory-bytes: vLLM skips its memory profiling, so the servers can start side by side (1 GiB: about
# the 32,768 tokens of the earlier Moonlight runs' --kv-cache-tokens, at 31 KB a token).
(VLLM_RELOAD_MODE=direct timeout -s INT -k 20 "${MOON_S:-480}" python3 scripts/benchmark.py \
   --model moonlight-16b-a3b-shape --num-gpus 1 --loaders direct vllm --rounds 5 --kv-cache-memory-bytes 1073741824 \
   --out "$R/moonlight.json" --server-log "$R/moonlight.server.log" > "$R/moonlight.out" 2>&1
 echo "rc=$?" >> "$R/moonlight.out") &
sleep 15
E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
STAGGER_S=4 bash scripts/gpu_parallel.sh "$R" small "${PAR_S:-420}" \
 "tiny-5|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rounds 5 --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648" \
 "swapped-experts|scripts/with_worker.py swapped_experts_worker.SwappedExpertsWorker --model tiny-qwen2-moe --num-gpus 1 --weight-loader vllm --rounds 2 $E" \
 "dsv3-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny-deepseek-v3 --num-gpus 1 --rollout-dtype fp8 --train --rounds 3 $E" \
 "mixtral-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny-mixtral --num-gpus 1 --rollout-dtype fp8 --train --rounds 3 $E" \
 "tiny-loaders|scripts/benchmark.py --model tiny --num-gpus 1 --loaders direct vllm --check-coverage $E" > "$R/small.txt" 2>&1
wait
gzip -f "$R/moonlight.server.log"
