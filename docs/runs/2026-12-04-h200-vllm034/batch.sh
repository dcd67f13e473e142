# vLLM 0.34.0 on one H200. Run from the repository's root on the GPU machine, with the bundle of
# shared/gpu-host/wheels-vllm-0.34.txt installed; results under $1 (default /root/res/034).
# Each stage fits one call of its own:
#   bash batch.sh families OUT   every preset family side by side (eager, small servers): tiny through
#                                both loaders with --check-coverage, tiny-deepseek-v3 --train, tiny in FP8
#                                with --train, and benchmark.py's two-loader comparison (bit for bit) for
#                                every other family (tiny-gpt-oss: vLLM's loader only, as the direct
#                                loader refuses its transposed experts)
#   bash batch.sh moonlight OUT  the Moonlight-16B-A3B shape (compiled): 5 syncs through each loader, vLLM's
#                                own in its in-place reload (VLLM_RELOAD_MODE=direct), then the two loaders'
#                                parameters compared bit for bit
set -u
stage=${1:-families}; R=${2:-/root/res/034}; mkdir -p "$R"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$R/nvidia-smi.txt" 2>&1
python3 -c "import vllm, torch, transformers, huggingface_hub as h; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| huggingface_hub', h.__version__)" >> "$R/nvidia-smi.txt" 2>&1
case "$stage" in
families)
  E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
  STAGGER_S=5 bash scripts/gpu_parallel.sh "$R" families "${PAR_S:-430}" \
   "tiny-direct|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rounds 3 --check-coverage $E" \
   "tiny-vllm|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rounds 3 --check-coverage --weight-loader vllm $E" \
   "dsv3-train|rlhf_ipc_fsdp_ep.py --model tiny-deepseek-v3 --num-gpus 1 --train --rounds 3 $E" \
   "tiny-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rollout-dtype fp8 --train --rounds 3 --check-coverage $E" \
   "qwen2moe-loaders|benchmark.py --model tiny-qwen2-moe --num-gpus 1 --rounds 2 $E" \
   "mixtral-loaders|benchmark.py --model tiny-mixtral --num-gpus 1 --rounds 2 $E" \
   "dsv3-loaders|benchmark.py --model tiny-deepseek-v3 --num-gpus 1 --rounds 2 $E" \
   "glm4moe-loaders|benchmark.py --model tiny-glm4-moe --num-gpus 1 --rounds 2 $E" \
   "gptoss-vllm|benchmark.py --model tiny-gpt-oss --num-gpus 1 --rounds 2 --loaders vllm $E" \
   "qwen3-loaders|benchmark.py --model tiny-qwen3 --num-gpus 1 --rounds 2 $E" > "$R/families.txt" 2>&1 ;;
moonlight)
  VLLM_RELOAD_MODE=direct timeout -s INT -k 30 "${MOON_S:-540}" python3 benchmark.py --model moonlight-16b-a3b-shape \
    --num-gpus 1 --loaders direct vllm --rounds 5 --kv-cache-tokens 32768 \
    --out "$R/moonlight.json" --server-log "$R/moonlight.server.log" > "$R/moonlight.out" 2>&1
  echo "rc=$?" >> "$R/moonlight.out"
  gzip -f "$R/moonlight.server.log" ;;
esac
