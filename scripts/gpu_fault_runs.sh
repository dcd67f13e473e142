#!/usr/bin/env bash
# The failure cases that need a GPU: Ctrl-C / SIGTERM in each phase, and the
# server killed while the job runs. Each case starts the script (tiny model, one
# GPU), waits for a line of its output that marks the phase, signals it, then
# records the exit code, how long the exit took, what was left running and the
# GPU memory still in use.
# usage: bash scripts/gpu_fault_runs.sh OUT_DIR
set -u
# Job control: without it bash starts background jobs with SIGINT ignored, and a
# "Ctrl-C" sent to them would test nothing. With it each job also leads its own
# process group, as a terminal's foreground job does.
set -m
out=${1:?OUT_DIR}
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1
summary=$out/fault-cases.txt
: > "$summary"

# name | output line that marks the phase | seconds to wait after it | what to do
cases=(
  "start-sigint|starting vllm serve|15|group INT"
  "start-sigterm|starting vllm serve|15|group TERM"
  "sleep-sigint|[sleep] ...|0|group INT"
  "send-sigterm|[send] ...|0|group TERM"
  "generation-sigint|=== round 2/|0|group INT"
  "server-killed-before-send|[wake_weights] ...|0|kill-server"
)
for case in "${cases[@]}"; do
  IFS='|' read -r name marker delay action <<< "$case"
  log=$out/logs/$name.out
  # "group INT" below is then exactly what Ctrl-C in a terminal sends.
  ${PROGRAM:-python3 rlhf_ipc_fsdp_ep.py} --model tiny --num-gpus 1 --enforce-eager --rounds 100000 \
    --server-log "$out/logs/$name.server.log" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 900); do grep -qF -- "$marker" "$log" && break; sleep 0.2; done
  sleep "$delay"
  phase=$(grep -oE '^\[[a-z_]+\] \.\.\.$|^=== round [0-9]+|starting vllm serve' "$log" | tail -1)
  t0=$(date +%s%N)
  case $action in
    "group INT") kill -INT -- "-$pid" ;;
    "group TERM") kill -TERM -- "-$pid" ;;
    kill-server) pkill -9 -f 'EngineCore|vllm.entrypoints' ;;
  esac
  for _ in $(seq 900); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then  # still running after 90 s: a failure; do not hang
    kill -KILL -- "-$pid"; echo "    DID NOT EXIT within 90 s of the signal" | tee -a "$summary"
  fi
  wait "$pid"; rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  sleep 2
  vllm_left=$(pgrep -fc 'vllm.entrypoints|EngineCore|VLLM' || true)
  ray_left=$(pgrep -fc 'raylet|gcs_server|ray::' || true)
  mem=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' ')
  printf '%-26s phase at signal: %-22s rc=%-4s exit after %6d ms | vllm left %s | ray left %s | GPU memory used: %s\n' \
    "$name" "$phase" "$rc" "$ms" "$vllm_left" "$ray_left" "$mem" | tee -a "$summary"
  grep -E "^error:|Error|FAILED|\[shutdown\]" "$log" | tail -3 | sed 's/^/    /' | tee -a "$summary"
  pkill -9 -f 'EngineCore|vllm.entrypoints|raylet|gcs_server' 2>/dev/null; sleep 1
done
tar czf "$out/fault-logs.tgz" -C "$out" logs && rm -rf "$out/logs"
