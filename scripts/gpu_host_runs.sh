#!/usr/bin/env bash
# The GPU runs we report, several variants in one go on a GPU machine (docs/DEVELOPING.md).
# usage: bash scripts/gpu_host_runs.sh OUT_DIR VARIANT...
#   VARIANT is name:seconds:program flags, e.g.
#     "tiny-n2:240:rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 2"
#     "30b-n2:420:scripts/benchmark.py --model qwen3-30b-a3b-shape --num-gpus 2"
# Each variant writes OUT_DIR/<name>.json; all outputs and server logs end up
# in OUT_DIR/logs.tgz. A variant that fails or times out does not stop the rest.
set -u
out=${1:?OUT_DIR}; shift
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$out/logs/nvidia-smi.txt" 2>&1
for variant in "$@"; do
  name=${variant%%:*}; rest=${variant#*:}; secs=${rest%%:*}; cmd=${rest#*:}
  program=${cmd%% *}
  json_flag=--json; [ "$program" = scripts/benchmark.py ] && json_flag=--out
  echo "=== $name (limit ${secs}s): python3 $cmd"
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout -s INT -k 30 "$secs" python3 $cmd $json_flag "$out/$name.json" \
    --server-log "$out/logs/$name.server.log" > "$out/logs/$name.out" 2>&1
  echo "rc=$? after $(( $(date +%s) - start ))s"
  grep -E "^\[gate\]|^\[send\]|^\[agree\]|^\[server\] healthy|Error|error:|FAILED" "$out/logs/$name.out" | tail -30
  sed -n '/^model /,$p' "$out/logs/$name.out" | head -40
  echo "leftover vllm processes: $(pgrep -fc 'vllm.entrypoints|EngineCore|VLLM' || true)"
  pgrep -fa 'vllm.entrypoints|EngineCore|VLLM' | cut -c1-200 | sed 's/^/  leftover: /' || true
done
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
