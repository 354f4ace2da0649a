# One device call (H200): the GPU suite, then the GDN step bench, from a checkout root that holds .gpu-vllm (carry
# it):  set -o pipefail; bash bench/kernels/device_gated.sh 2>&1
# Env: SKIP_TESTS, TEST_TIMEOUT (s), SHARDS (pytest processes on the one GPU), TEST_ARGS (pytest selection);
# SKIP_BENCH, BENCH_TIMEOUT, BENCH_ARGS (bench/kernels/gated_bench.py's; default: every chain and tree row);
# BASELINE_CMD: a command run before the bench, e.g. an older checkout's own bench on the same rows (carried under
# an ignored folder), for a before/after table (bench/kernels/compare_gated.py); TRITON_CACHE_DIR: a carried Triton cache
# (bench/kernels/compile_report.py --modes fused verify fills one offline), so the bench does not compile on the device.
# Files back in $OUT: smi.txt, gpu_tests.log, gpu_shards.tgz, baseline.log, gated.log, gated.json (+ the
# baseline's JSON where BASELINE_CMD writes it).
set -o pipefail
source .gpu-vllm/device-setup.sh
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
  --format=csv > $OUT/smi.txt 2>&1
status=0
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-240} bash tests/gpu/run_sharded.sh /tmp/gpu ${SHARDS:-8} ${TEST_ARGS:-} > $OUT/gpu_tests.log 2>&1
  status=$?
  tar czf $OUT/gpu_shards.tgz -C /tmp gpu
  tail -n 12 $OUT/gpu_tests.log
fi
if [ -n "$BASELINE_CMD" ]; then
  timeout ${BENCH_TIMEOUT:-200} bash -c "$BASELINE_CMD" > $OUT/baseline.log 2>&1
  grep -E "done in|Error|error" $OUT/baseline.log | cut -c1-200 | tail -5
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-200} python3 bench/kernels/gated_bench.py --out $OUT ${BENCH_ARGS:-} > $OUT/gated.log 2>&1
  grep -E "^\| |done in|Error|error" $OUT/gated.log | cut -c1-200
fi
exit $status
