#!/usr/bin/env bash
# The next GPU session's measurements (issues 30, 34, 31), one device call per part (A about 4.5 minutes, B about 4,
# C about 3.5; with the start, within a session's 15 minutes; scripts/gpu/README.md section 5):
#   bash scripts/gpu/run_wave.sh A   issue 30: weights, gradients and AdamW on the host (bench_gpu_param_offload):
#                                    xsched as it is, issued by one thread, with the host AdamW on every core, FSDP2
#   bash scripts/gpu/run_wave.sh B   issue 34 (compiled plans beside torch.compile), the GPU tests of this wave
#   bash scripts/gpu/run_wave.sh C   issue 31 (the chunked loss at checkpoint's peak, planned addresses without the
#                                    composites' copies)
#   bash scripts/gpu/run_wave.sh D   issue 31 at 45% and 25% with the step users run, loss.backward() (no logits
#                                    tangent; BENCHMARKS §29b), DEADLINE_D as C's
#   bash scripts/gpu/run_wave.sh E   issue 30's bf16 rows and the Llama (DEADLINE_E, default 200), if time is left
# Each benchmark runs under its own --deadline and copies its table to $OUT as it finishes; the raw files go back as
# results-<part>.tgz. Prefix the install of scripts/gpu/README.md section 5 (wheels into /tmp/site, PYTHONPATH).
# C's deadline: DEADLINE_C seconds (default 200; give it the session's budget_left_s less 30).
set -u
PART=${1:-A}
R=/tmp/r$PART; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, pyomo.environ, highspy; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
if [ "$PART" = A ]; then
  timeout 300 python3 scripts/bench_gpu_param_offload.py --deadline 290 \
    --rows reference,xsched,xsched_one,xsched_allcores,fsdp2 --json $R/param_offload.json \
    --out $R/param_offload.md --trace $R/traces > $R/po.log 2>&1
  cp $R/param_offload.md $R/param_offload.json "$OUT"/ 2>/dev/null; tail -40 $R/po.log
elif [ "$PART" = E ]; then
  D=${DEADLINE_E:-200}
  timeout $((D + 10)) python3 scripts/bench_gpu_param_offload.py --deadline $D \
    --rows reference_bf16,xsched_fast,llama --json $R/param_offload_bf16.json \
    --out $R/param_offload_bf16.md --trace $R/traces > $R/po.log 2>&1
  cp $R/param_offload_bf16.md $R/param_offload_bf16.json "$OUT"/ 2>/dev/null; tail -40 $R/po.log
elif [ "$PART" = B ]; then
  timeout 235 python3 scripts/bench_compile.py --device cuda:0 --iters 8 --deadline 215 --profile-s 10 --no-settle \
    --json $R/compile.json --out $R/compile.md > $R/compile.log 2>&1
  cp $R/compile.md $R/compile.json "$OUT"/ 2>/dev/null; tail -20 $R/compile.log
  timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_device_dtypes.py tests/test_executor_gpu.py \
    tests/test_device_kernels.py tests/test_held_release.py \
    > $R/gpu_tests.log 2>&1
  tail -8 $R/gpu_tests.log
elif [ "$PART" = D ]; then
  D=${DEADLINE_D:-200}
  timeout $((D + 10)) python3 scripts/bench_gpu_memory.py --loss-backward --budgets 45,25 --chunk-loss 8 --deadline $D \
    --no-compile --no-xsched-compile --out $R/gpu_memory_lb.md --json $R/gpu_memory_lb.json > $R/mem_lb.log 2>&1
  cp $R/gpu_memory_lb.md $R/gpu_memory_lb.json "$OUT"/ 2>/dev/null; tail -40 $R/mem_lb.log
else
  D=${DEADLINE_C:-200}
  timeout $((D + 10)) python3 scripts/bench_gpu_memory.py --budgets 55,45 --chunk-loss 8 --deadline $D \
    --no-compile --no-xsched-compile --out $R/gpu_memory.md --json $R/gpu_memory.json --save-profile $R > $R/mem.log 2>&1
  cp $R/gpu_memory.md $R/gpu_memory.json "$OUT"/ 2>/dev/null; tail -40 $R/mem.log
fi
# the traces apart (16 MiB a file comes back): a trace too large loses itself, not the results
[ -d $R/traces ] && tar czf "$OUT"/traces-$PART.tgz -C $R traces
tar czf "$OUT"/results-$PART.tgz --exclude=traces -C /tmp r$PART
