#!/usr/bin/env bash
# The next GPU session's measurements (issues 30, 31, 34), in two device calls (A about 5.5 minutes, B about 6.5; with the start, within a session's 15 minutes):
#   bash scripts/gpu/run_wave.sh A   issue 30: weights, gradients and AdamW on the host (bench_gpu_param_offload)
#   bash scripts/gpu/run_wave.sh B   issue 31 (memory: chunked loss, expandable segments, copy pools) and issue 34
#                                    (compiled plans), then the GPU executor tests and the back-to-back calibration
# Each benchmark runs under its own --deadline and copies its table to $OUT as it finishes; the raw files go back as
# results-<part>.tgz. Prefix the install of scripts/gpu/README.md section 5 (wheels into /tmp/site, PYTHONPATH).
set -u
PART=${1:-A}
R=/tmp/r$PART; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, pyomo.environ, highspy; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
if [ "$PART" = A ]; then
  timeout 330 python3 scripts/bench_gpu_param_offload.py --deadline 320 \
    --rows reference,xsched,fsdp2,reference_bf16,xsched_fast,llama --json $R/param_offload.json \
    --out $R/param_offload.md > $R/po.log 2>&1
  cp $R/param_offload.md $R/param_offload.json "$OUT"/ 2>/dev/null; tail -40 $R/po.log
else
  # 25% is below the original graph's proven bound: that row says so at once; the chunked rows plan it. Every xsched
  # row is measured again with expandable segments and with planned addresses (BENCHMARKS 19, 23)
  timeout 200 python3 scripts/bench_gpu_memory.py --budgets 55,45,25 --chunk-loss 8 --deadline 190 \
    --out $R/gpu_memory.md --json $R/gpu_memory.json --save-profile $R > $R/mem.log 2>&1
  cp $R/gpu_memory.md $R/gpu_memory.json "$OUT"/ 2>/dev/null; tail -45 $R/mem.log
  timeout 90 python3 scripts/bench_compile.py --device cuda:0 --iters 8 --out $R/compile.md > $R/compile.log 2>&1
  cp $R/compile.md "$OUT"/ 2>/dev/null; tail -15 $R/compile.log
  timeout 40 python3 -m pytest -q -x tests/test_executor_gpu.py tests/test_alloc_settings.py > $R/gpu_tests.log 2>&1
  tail -5 $R/gpu_tests.log
  timeout 60 python3 scripts/bench_back_to_back.py --device cuda:0 --deadline 55 > $R/b2b.log 2>&1
  tail -15 $R/b2b.log
fi
tar czf "$OUT"/results-$PART.tgz -C /tmp r$PART
