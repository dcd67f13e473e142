# FP8 experts on one H200 (vLLM 0.33.0). Run from the repository's root on the GPU machine; results in
# /root/res/fp8 (M1, M2, DONE mark the stages reached). Each stage fits one call of its own (the bundle
# installed in it or an earlier call on the same host):
#   bash batch.sh families     the quantizer against vLLM's function (and Inductor's generated code), then
#                              the families side by side (eager, small servers): tiny and tiny-deepseek-v3
#                              and tiny-mixtral in FP8 with --train, tiny-mixtral through both loaders in FP8
#   bash batch.sh moonlight bf16|fp8
#                              the Moonlight-16B-A3B shape (compiled): 5 syncs through the direct loader
#                              with the exact check and the gate, then 64 prompts x 256 tokens generated
#   bash batch.sh moonlight-loaders
#                              the Moonlight shape in FP8 through both loaders, 2 syncs each: their FP8 bytes compared
set -u
R=/root/res/fp8; mkdir -p $R
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > $R/nvidia-smi.txt 2>&1
case "${1:-families}" in
families)
  TORCH_LOGS=output_code python3 scripts/fp8_quantizer_check.py --json $R/quantizer.json > $R/quantizer.txt 2> $R/inductor-code.txt
  touch $R/M1
  E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
  STAGGER_S=6 bash scripts/gpu_parallel.sh $R/par par ${PAR_S:-380} \
   "tiny-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rollout-dtype fp8 --train --rounds 5 --check-coverage $E" \
   "dsv3-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny-deepseek-v3 --num-gpus 1 --rollout-dtype fp8 --train --rounds 5 --check-coverage $E" \
   "mixtral-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny-mixtral --num-gpus 1 --rollout-dtype fp8 --train --rounds 5 --check-coverage $E" \
   "mixtral-fp8-loaders|benchmark.py --model tiny-mixtral --num-gpus 1 --rollout-dtype fp8 --rounds 2 $E" > $R/par.txt 2>&1
  touch $R/M2 ;;
moonlight)
  dtype=${2:?bf16 or fp8}
  timeout -s INT -k 30 ${MOON_S:-540} python3 benchmark.py --model moonlight-16b-a3b-shape --num-gpus 1 --loaders direct \
    --rounds 5 --kv-cache-tokens 32768 --throughput 64x256 --rollout-dtype $dtype \
    --out $R/moonlight-$dtype.json --server-log $R/moonlight-$dtype.server.log > $R/moonlight-$dtype.out 2>&1
  echo "rc=$?" >> $R/moonlight-$dtype.out
  gzip -f $R/moonlight-$dtype.server.log ;;
moonlight-loaders)
  timeout -s INT -k 20 ${MOON_S:-370} python3 benchmark.py --model moonlight-16b-a3b-shape --num-gpus 1 --loaders direct vllm \
    --rounds 2 --kv-cache-tokens 32768 --rollout-dtype fp8 \
    --out $R/moonlight-fp8-loaders.json --server-log $R/moonlight-fp8-loaders.server.log > $R/moonlight-fp8-loaders.out 2>&1
  echo "rc=$?" >> $R/moonlight-fp8-loaders.out
  gzip -f $R/moonlight-fp8-loaders.server.log ;;
esac
touch $R/DONE
