#!/usr/bin/env bash
# Two nodes on one GPU machine: a Ray cluster of two nodes, one GPU
# each (a head and a worker, each started with one GPU visible), then the runs
# given, as scripts/gpu_host_runs.sh takes them, against that cluster.
# usage: bash scripts/gpu_two_nodes.sh OUT_DIR VARIANT...
#   e.g. "tiny-2nodes:300:rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 2 --num-nodes 2 --check-coverage"
set -u
out=${1:?OUT_DIR}; shift
mkdir -p "$out/logs"
ray() { python3 -m ray.scripts.scripts "$@"; }
ip=$(python3 -c "import ray._private.services as s; print(s.get_node_ip_address())")
port=6380
CUDA_VISIBLE_DEVICES=0 ray start --head --port $port --num-gpus 1 --num-cpus 8 --include-dashboard=false \
  --disable-usage-stats > "$out/logs/ray-head.txt" 2>&1
CUDA_VISIBLE_DEVICES=1 ray start --address "$ip:$port" --num-gpus 1 --num-cpus 8 \
  --disable-usage-stats > "$out/logs/ray-worker.txt" 2>&1
ray status --address "$ip:$port" > "$out/logs/ray-status.txt" 2>&1
grep -E "GPU|node_" "$out/logs/ray-status.txt"
RAY_ADDRESS="$ip:$port" bash "$(dirname "$0")/gpu_host_runs.sh" "$out" "$@"
ray stop --force > /dev/null 2>&1
echo "leftover ray processes: $(pgrep -fc 'raylet|gcs_server' || true)"
