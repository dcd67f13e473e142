# FP8 experts on one H200 (vLLM 0.33.0): the quantizer against vLLM's function, then the families
# side by side (eager, small servers).
# Run from the repository's root on the GPU machine; results in /root/res/fp8.
set -u
R=/root/res/fp8; mkdir -p $R
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > $R/nvidia-smi.txt 2>&1
export PYTHONUNBUFFERED=1
TORCH_LOGS=output_code python3 scripts/fp8_quantizer_check.py --json $R/quantizer.json > $R/quantizer.txt 2> $R/inductor-code.txt
touch $R/M1
E="--enforce-eager --gpu-memory-utilization 0.05 --kv-cache-memory-bytes 2147483648"
STAGGER_S=6 bash scripts/gpu_parallel.sh $R/par par ${PAR_S:-270} \
 "tiny-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny --num-gpus 1 --rollout-dtype fp8 --train --rounds 5 --check-coverage $E" \
 "dsv3-fp8-train|rlhf_ipc_fsdp_ep.py --model tiny-deepseek-v3 --num-gpus 1 --rollout-dtype fp8 --train --rounds 5 --check-coverage $E" \
 "mixtral-fp8-loaders|benchmark.py --model tiny-mixtral --num-gpus 1 --rollout-dtype fp8 --rounds 2 $E" > $R/par.txt 2>&1
touch $R/M2
touch $R/DONE
