#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The runs behind the README's headline numbers, on one H200: run from the repository's root on the GPU machine
# with the bundle of shared/gpu-host/wheels-vllm-0.34.txt installed; results under OUT.
#   COMMIT=<hash> bash scripts/h200_sync_runs.sh STAGE OUT    # STAGE a1, a2, b1, b2, b3 in turn, on one machine
#   (each within 10 minutes, c1 and b1 together; a2 and b2 read the checkpoint a1 writes)
# a1: the README's tiny command, cold (nothing compiled yet), alone on the GPU, while the Moonlight-16B-A3B shape is
#    written to disk as a checkpoint; a2: that checkpoint through both loaders, compiled, sleep level 0: the direct
#    loader beside vLLM's fastest mode (its in-place reload, VLLM_RELOAD_MODE=direct), 5 syncs each, then both
#    bit for bit. A sixth sync of each loader, the direct loader's profiled (cProfile on the trainer and the
#    engine); the five before it are the numbers.
# b1: the README's tiny command again (warm caches), alone; b2: the same checkpoint with the routed experts served
#    in FP8 (direct loader, 5 syncs and a sixth profiled, compiled) and, side by side while its server starts: helpers.py and weight_sync/ray_trainers.py alone in an
#    empty folder with a user's own trainer (tests/ray_trainer_rl.py: IPC send, vLLM's loader, a dense model),
#    tiny with --rounds 3, tiny-deepseek-v3 with --train.
# b3: side by side, eager: every preset family through each loader it takes (2 syncs each, then both bit for
#    bit), tiny-mixtral in FP8 with --train, and a stale engine (tests/stale_block_worker.py: from the second
#    sync on, one expert block left as it was), which the exact check must fail, named.
# c1: the FP8 run of b2 alone (the checkpoint written first if a1 has not run on this machine): the FP8 sync
#    against a2's bf16 one without other jobs on the GPU. Before vllm_adapter.serve_env it needed more than 80 GB: on an
#    H100 80GB vLLM's start ran out of memory quantizing the experts beside the trainer's 30 GiB (9f57da0).
# d1 and d2, for an 80 GB GPU, d1 first (each within 10 minutes; d2 writes the checkpoint again on a fresh machine):
# d1: while the checkpoint is written, scripts/fp8_start_memory_check.py three times side by side (three of the
#    Moonlight shape's MoE layers quantized to FP8 as vLLM's start does, in its sleep-mode pool: with PyTorch's default
#    allocator settings; with those vllm_adapter.serve_env gives an FP8 server; with vLLM's split limit at 21 MiB instead
#    of 20, the other way out); then the checkpoint with the routed experts served in FP8, direct loader, sleep
#    level 0, 5 syncs, compiled.
# d2: the same checkpoint in bf16, one server: the direct loader at sleep level 0, then at level 2, 5 syncs each.
# t1: a user's trainer under torchrun without Ray (tests/torchrun_rl.py), beside the copy table's first row alone in
#    an empty folder: a tiny MoE checkpoint, the default process group NCCL alone, the server on the checkpoint's
#    weights, two rounds through the direct loader and two through vLLM's, vLLM checked against the trainer after each.
set -u
stage=${1:?a1, a2, b1, b2, b3, c1, d1, d2 or t1}; R=${2:?OUT}; mkdir -p "$R/logs"
export PYTHONUNBUFFERED=1
CKPT=/root/ckpt-moonlight
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%T.%N | cut -c1-12)" "$line"; done; }
run() {  # name seconds program flags...: one run, its output time-stamped line by line
  local name=$1 secs=$2; shift 2
  local json_flag=--json; [ "$1" = scripts/benchmark.py ] && json_flag=--out
  echo "=== $name: python3 $*" > "$R/logs/$name.out"
  { timeout -s INT -k 30 "$secs" python3 "$@" "$json_flag" "$R/$name.json" --server-log "$R/logs/$name.server.log" 2>&1
    echo "rc=$?"; } | stamp >> "$R/logs/$name.out"
}
summary() {
  for f in "$R"/logs/*.out; do
    echo "=== $(basename "$f" .out): $(tail -1 "$f")"
    grep -E "healthy after|\[floor\] a sync|\[exact\]|\[gate\]|\[agree\]|\[sync\]|\[check\]|once vLLM slept|vLLM holds|process group:|serves after|group left|error:|Error|FAILED|warning:|rc=" \
      "$f" | cut -c1-300 | tail -13
    log="${f%.out}.server.log"  # the engines' own lines: vLLM's early import, whether each sync kept its copies
    [ -f "$log" ] && grep -E "\[wait for flags\]|a weight is off|Model loading took|CUDA out of memory" "$log" |
      cut -c1-200 | head -4
    [ -f "$log" ] && echo "in-place copies kept: $(grep -c 'in-place copies kept' "$log"), worked out: $(grep -c 'in-place copies worked out' "$log")"
  done
  # The GPU's memory sampled every half second through d1's and d2's jobs: the most it held, the start's included.
  [ -f "$R/logs/gpu-memory.csv" ] && echo "GPU memory used, the most sampled: $(sort -n "$R/logs/gpu-memory.csv" |
    tail -1) MiB of $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) MiB"
  echo "leftover vllm processes: $(pgrep -fc 'vllm.entrypoints|EngineCore|VLLM' || true)"
}
start_sampling_gpu_memory() {  # MiB used on GPU 0, a line every 500 ms, until `kill $sampler`
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 500 >> "$R/logs/gpu-memory.csv" &
  sampler=$!
}
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
  echo "commit ${COMMIT:-unknown}"
} > "$R/versions-$stage.txt" 2>&1
if [ "$stage" = a1 ]; then
  (python3 scripts/write_shape_checkpoint.py moonlight-16b-a3b-shape "$CKPT" > "$R/logs/checkpoint-write.out" 2>&1
   echo "rc=$?" >> "$R/logs/checkpoint-write.out") &
  run tiny-cold 300 rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1
  wait
elif [ "$stage" = a2 ]; then
  VLLM_RELOAD_MODE=direct run moonlight-checkpoint 540 scripts/benchmark.py --model "$CKPT" --num-gpus 1 \
    --loaders direct vllm --rounds 6 --profile-round 6 --kv-cache-memory-bytes 1073741824
elif [ "$stage" = b3 ]; then
  E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
  for preset in tiny-qwen2-moe tiny-mixtral tiny-deepseek-v3 tiny-glm4-moe tiny-qwen3; do
    run "$preset-loaders" 330 scripts/benchmark.py --model "$preset" --num-gpus 1 --loaders direct vllm --rounds 2 $E &
    sleep 4
  done
  run tiny-gpt-oss-vllm 330 scripts/benchmark.py --model tiny-gpt-oss --num-gpus 1 --loaders vllm --rounds 2 $E &
  sleep 4
  run mixtral-fp8-train 330 rlhf_ipc_fsdp_ep.py --model tiny-mixtral --num-gpus 1 --rollout-dtype fp8 --train \
    --rounds 3 $E &
  sleep 4
  run stale-engine 330 scripts/with_worker.py stale_block_worker.StaleBlockWorker --model tiny --num-gpus 1 --train \
    --rounds 3 $E &
  wait
elif [ "$stage" = c1 ]; then
  [ -f "$CKPT/config.json" ] || python3 scripts/write_shape_checkpoint.py moonlight-16b-a3b-shape "$CKPT" \
    > "$R/logs/checkpoint-write.out" 2>&1
  run moonlight-checkpoint-fp8 360 scripts/benchmark.py --model "$CKPT" --num-gpus 1 --loaders direct \
    --rollout-dtype fp8 --rounds 6 --profile-round 6 --kv-cache-memory-bytes 1073741824
elif [ "$stage" = d1 ]; then
  [ -f "$CKPT/config.json" ] || (python3 scripts/write_shape_checkpoint.py moonlight-16b-a3b-shape "$CKPT" \
    > "$R/logs/checkpoint-write.out" 2>&1; echo "rc=$?" >> "$R/logs/checkpoint-write.out") &
  for how in defaults serve-env split-21; do
    flag=; [ $how = serve-env ] && flag=--serve-env; [ $how = split-21 ] && flag="--split-mb 21"
    { timeout -k 10 150 env -u PYTORCH_CUDA_ALLOC_CONF python3 scripts/fp8_start_memory_check.py $flag \
        --json "$R/fp8-start-$how.json" 2>&1
      echo "rc=$?"; } | stamp > "$R/logs/fp8-start-$how.out" &
  done
  wait
  start_sampling_gpu_memory
  run moonlight-checkpoint-fp8 330 scripts/benchmark.py --model "$CKPT" --num-gpus 1 --loaders direct \
    --rollout-dtype fp8 --rounds 5 --kv-cache-memory-bytes 1073741824
  kill $sampler
elif [ "$stage" = d2 ]; then
  [ -f "$CKPT/config.json" ] || python3 scripts/write_shape_checkpoint.py moonlight-16b-a3b-shape "$CKPT" \
    > "$R/logs/checkpoint-write.out" 2>&1
  start_sampling_gpu_memory
  run moonlight-checkpoint-bf16 420 scripts/benchmark.py --model "$CKPT" --num-gpus 1 --variants direct:0 direct:2 \
    --rounds 5 --kv-cache-memory-bytes 1073741824
  kill $sampler
elif [ "$stage" = t1 ]; then
  rm -rf /root/torchrun && mkdir -p /root/torchrun/weight_sync
  cp helpers.py tests/torchrun_rl.py /root/torchrun/
  cp weight_sync/__init__.py weight_sync/sources.py weight_sync/direct_load.py weight_sync/vllm_adapter.py /root/torchrun/weight_sync/
  python3 - <<'EOF' > "$R/logs/tiny-checkpoint.out" 2>&1
import sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
sys.path.insert(0, ".")
from weight_sync import models
path = models.build_preset("tiny", Path("/root/tiny-moe"))
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
models.init_random_weights(model, seed=1)
model.save_pretrained(path)
EOF
  (cd /root/torchrun && PYTHONPATH=/root/torchrun:$PYTHONPATH timeout -k 10 400 python3 -m torch.distributed.run \
     --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" torchrun_rl.py /root/tiny-moe 2>&1 | stamp
   echo "rc=${PIPESTATUS[0]}"; cp server.log "$R/logs/torchrun.server.log") > "$R/logs/torchrun.out" 2>&1
elif [ "$stage" = b1 ]; then
  run tiny-warm 200 rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1
else
  run moonlight-checkpoint-fp8 520 scripts/benchmark.py --model "$CKPT" --num-gpus 1 --loaders direct \
    --rollout-dtype fp8 --rounds 6 --profile-round 6 --kv-cache-memory-bytes 1073741824 &
  sleep 10
  E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
  run tiny-3-rounds 300 rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rounds 3 $E &
  run dsv3-train 300 rlhf_ipc_fsdp_ep.py --model tiny-deepseek-v3 --num-gpus 1 --train --rounds 3 $E &
  (python3 - <<'EOF'
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
sys.path.insert(0, ".")
from weight_sync import models
path = models.build_preset("tiny-qwen3", Path("/root/dense"))
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
models.init_random_weights(model, seed=2)
model.save_pretrained(path)
Path("/root/alone/weight_sync").mkdir(parents=True, exist_ok=True)
for f, to in [("helpers.py", ""), ("weight_sync/__init__.py", "weight_sync"), ("weight_sync/ray_trainers.py", "weight_sync"),
              ("tests/ray_trainer_rl.py", "")]:
    shutil.copy(f, Path("/root/alone", to))
EOF
   cd /root/alone && timeout 300 python3 ray_trainer_rl.py /root/dense 2>&1 | stamp
   cp /root/alone/server.log "$R/logs/helpers-alone.server.log") > "$R/logs/helpers-alone.out" 2>&1
  wait
fi
summary > "$R/summary-$stage.txt" 2>&1
mv "$R"/*.direct-round* "$R"/tiny-3-rounds.json "$R"/dsv3-train.json "$R"/tiny-*-loaders.json "$R"/tiny-gpt-oss-vllm.json \
  "$R"/mixtral-fp8-train.json "$R"/stale-engine.json "$R/logs/" 2>/dev/null
cat "$R/summary-$stage.txt"
tar czf "$R/logs-$stage.tgz" -C "$R" logs && rm -rf "$R/logs"
