#!/usr/bin/env bash
# Several small runs side by side on one GPU (each its own local Ray and
# server, each with --gpu-memory-utilization small enough for all), started a
# few seconds apart; then one line per run. Output and server logs go to
# OUT_DIR/logs, each run's JSON to OUT_DIR/json; both end up in OUT_DIR/<tag>.tgz.
# usage: bash scripts/gpu_parallel.sh OUT_DIR TAG SECONDS "name|program flags" ...
set -u
out=${1:?OUT_DIR}; tag=${2:?TAG}; secs=${3:?SECONDS}; shift 3
mkdir -p "$out/logs" "$out/json"
export PYTHONUNBUFFERED=1
pids=()
for variant in "$@"; do
  name=${variant%%|*}; cmd=${variant#*|}
  program=${cmd%% *}
  json_flag=--json; [ "$program" = scripts/benchmark.py ] && json_flag=--out
  # shellcheck disable=SC2086
  ( timeout -s INT -k 30 "$secs" python3 $cmd $json_flag "$out/json/$name.json" \
      --server-log "$out/logs/$name.server.log" > "$out/logs/$name.out" 2>&1; echo "rc=$?" >> "$out/logs/$name.out" ) &
  pids+=($!)
  sleep "${STAGGER_S:-15}"
done
wait "${pids[@]}"
for variant in "$@"; do
  name=${variant%%|*}
  echo "=== $name: $(tail -1 "$out/logs/$name.out")"
  grep -E "^\[exact\]|^\[gate\]|^\[agree\]|^\[coverage\]|error:|Error|FAILED|warning:" "$out/logs/$name.out" | cut -c1-400 | tail -14
done
echo "leftover vllm processes: $(pgrep -fc 'vllm.entrypoints|EngineCore|VLLM' || true)"
nvidia-smi --query-gpu=memory.used --format=csv
tar czf "$out/$tag.tgz" -C "$out" logs json && rm -rf "$out/logs" "$out/json"
