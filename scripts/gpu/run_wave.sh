#!/usr/bin/env bash
# The wave's GPU run (issues 30, 31, 32): three prepared benchmarks in one device call, each within its own deadline.
set -u
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, pyomo.environ, highspy; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
timeout 240 python3 scripts/bench_gpu_param_offload.py --deadline 230 --rows reference,xsched,fsdp2,reference_bf16,xsched_fast,llama \
  --json $R/param_offload.json --out $R/param_offload.md > $R/po.log 2>&1
cp $R/param_offload.md $R/param_offload.json "$OUT"/ 2>/dev/null; tail -30 $R/po.log
timeout 170 python3 scripts/bench_gpu_memory.py --budgets 55,45 --deadline 160 --out $R/gpu_memory.md \
  --json $R/gpu_memory.json --save-profile $R > $R/mem.log 2>&1
cp $R/gpu_memory.md $R/gpu_memory.json "$OUT"/ 2>/dev/null; tail -30 $R/mem.log
timeout 75 python3 scripts/bench_hf.py --device cuda --profile-cap 6 --time-limit 4 --deadline 55 > $R/hf.log 2>&1
cp $R/hf.log "$OUT"/; tail -15 $R/hf.log
tar czf "$OUT"/results.tgz -C /tmp r
