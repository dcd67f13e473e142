# vLLM 0.34.0 on one H200, after batch1.sh on the same machine (it wrote /root/ckpt-moonlight); results under $1.
#   bash batch2.sh OUT
# 1. The Moonlight shape as a checkpoint on disk, each rank reading its own shards: the direct loader beside vLLM's
#    loader in its in-place reload (VLLM_RELOAD_MODE=direct), 3 syncs each, then both bit for bit.
# 2. vLLM's loader in its default layer-wise reload (VLLM_RELOAD_MODE=layerwise) on the Moonlight shape, 3 syncs.
# Eager servers (they start faster; the sync does not run compiled code), one after the other (each holds ~70 GB).
set -u
R=${1:?OUT}; mkdir -p "$R"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version,memory.used --format=csv > "$R/nvidia-smi.txt" 2>&1
git log -1 --format='commit %H' >> "$R/nvidia-smi.txt" 2>/dev/null
K="--enforce-eager --kv-cache-memory-bytes 1073741824"
VLLM_RELOAD_MODE=direct timeout -s INT -k 20 "${CKPT_S:-300}" python3 scripts/benchmark.py --model /root/ckpt-moonlight \
  --num-gpus 1 --loaders direct vllm --rounds 3 $K --out "$R/checkpoint.json" --server-log "$R/checkpoint.server.log" \
  > "$R/checkpoint.out" 2>&1
echo "rc=$?" >> "$R/checkpoint.out"
VLLM_RELOAD_MODE=layerwise timeout -s INT -k 20 "${LAYER_S:-240}" python3 scripts/benchmark.py \
  --model moonlight-16b-a3b-shape --num-gpus 1 --loaders vllm --rounds 3 $K \
  --out "$R/layerwise.json" --server-log "$R/layerwise.server.log" > "$R/layerwise.out" 2>&1
echo "rc=$?" >> "$R/layerwise.out"
gzip -f "$R/checkpoint.server.log" "$R/layerwise.server.log"
