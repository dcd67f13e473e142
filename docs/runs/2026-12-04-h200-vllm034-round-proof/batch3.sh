# vLLM 0.34.0, and 0.33.0, on one H200, with the server's watchdog inside helpers.py: run from the repository's root
# on the GPU machine, with the bundle of shared/gpu-host/wheels-vllm-0.34.txt on PYTHONPATH; results under $1.
#   SITE33=DIR bash batch3.sh OUT
# SITE33: vLLM 0.33.0 and transformers 5.20.2 (the newest vLLM 0.33.0 accepts) alone, installed with --no-deps; the
# 0.33.0 jobs put it first on PYTHONPATH (everything else vLLM 0.33.0 needs is in the 0.34.0 bundle, at the same
# versions). Side by side:
# - 0.34.0: the README's tiny command with 5 rounds (compiled); the fault cases the watchdog answers (the driver
#   SIGKILLed in the server's start and in the send: nothing may be left, and the next run must work);
# - 0.33.0: tiny through both loaders with --check-coverage, tiny-deepseek-v3 --train (its MLA layers rebuilt by
#   vLLM's post-load function, which the direct loader now calls on every version).
set -u
R=${1:?OUT}; mkdir -p "$R"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$R/nvidia-smi.txt" 2>&1
for site in "" "${SITE33:?}:"; do
  PYTHONPATH="$site$PYTHONPATH" python3 -c "import vllm, torch, transformers, huggingface_hub as h; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| huggingface_hub', h.__version__)" >> "$R/nvidia-smi.txt" 2>&1
done
(timeout -s INT -k 20 "${FAULT_S:-440}" python3 scripts/gpu_fault_matrix.py "$R/faults" start-sigkill send-sigkill \
   > "$R/faults.out" 2>&1; echo "rc=$?" >> "$R/faults.out") &
E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
(export PYTHONPATH="$SITE33:$PYTHONPATH"; STAGGER_S=4 bash scripts/gpu_parallel.sh "$R/v033" small "${PAR_S:-400}" \
   "tiny-loaders|scripts/benchmark.py --model tiny --num-gpus 1 --loaders direct vllm --check-coverage $E" \
   "dsv3-train|rlhf_ipc_fsdp_ep.py --model tiny-deepseek-v3 --num-gpus 1 --train --rounds 3 $E" > "$R/v033.txt" 2>&1) &
sleep 8
STAGGER_S=4 bash scripts/gpu_parallel.sh "$R" small "${PAR_S:-400}" \
  "tiny-5|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rounds 5 --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648" \
  > "$R/small.txt" 2>&1
wait
