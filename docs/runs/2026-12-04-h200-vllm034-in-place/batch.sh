# vLLM 0.34.0 on one H200, the exact check in place and the new layout: run from the repository's root on the
# GPU machine, with the bundle of shared/gpu-host/wheels-vllm-0.34.txt installed; results under $1.
#   bash batch.sh OUT
# 1. a tiny-qwen2-moe checkpoint written to disk (transformers' save names), then side by side (small servers):
#    the tiny command, 5 rounds (compiled); two experts swapped in every layer on the way into vLLM's loader
#    (must exit 1, the exact check naming every layer's w13 and w2); tiny-deepseek-v3 and tiny-mixtral in FP8
#    with --train; the checkpoint through the direct loader
# 2. the Moonlight-16B-A3B shape (compiled), 5 syncs through the direct loader: the exact check's seconds
set -u
R=${1:-/root/res/in-place}; mkdir -p "$R"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$R/nvidia-smi.txt" 2>&1
python3 -c "import vllm, torch, transformers, huggingface_hub as h; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| huggingface_hub', h.__version__)" >> "$R/nvidia-smi.txt" 2>&1
python3 scripts/write_shape_checkpoint.py tiny-qwen2-moe /root/ckpt-qwen2moe > "$R/checkpoint-write.txt" 2>&1
E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
STAGGER_S=4 bash scripts/gpu_parallel.sh "$R" small "${PAR_S:-180}" \
 "tiny-5|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rounds 5 --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648" \
 "swapped-experts|scripts/with_worker.py swapped_experts_worker.SwappedExpertsWorker --model tiny-qwen2-moe --num-gpus 1 --weight-loader vllm --rounds 2 $E" \
 "dsv3-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny-deepseek-v3 --num-gpus 1 --rollout-dtype fp8 --train --rounds 3 $E" \
 "mixtral-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny-mixtral --num-gpus 1 --rollout-dtype fp8 --train --rounds 3 $E" \
 "checkpoint|rlhf_ipc_fsdp_ep.py --model /root/ckpt-qwen2moe --num-gpus 1 --rounds 2 $E" > "$R/small.txt" 2>&1
timeout -s INT -k 20 "${MOON_S:-210}" python3 scripts/benchmark.py --model moonlight-16b-a3b-shape --num-gpus 1 \
  --loaders direct --rounds 5 --kv-cache-tokens 32768 \
  --out "$R/moonlight.json" --server-log "$R/moonlight.server.log" > "$R/moonlight.out" 2>&1
echo "rc=$?" >> "$R/moonlight.out"
gzip -f "$R/moonlight.server.log"
