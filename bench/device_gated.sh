# One device call (H200): bench, GPU tests, one ncu profile. Run from the checkout root of /work/main with this tree
# copied to .scratch/kernels:  bash .scratch/kernels/bench/device_gated.sh
set -o pipefail
source .gpu-vllm/device-setup.sh
cd .scratch/kernels
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
  --format=csv > $OUT/smi.txt 2>&1
BENCH_ARGS=${BENCH_ARGS:-}
timeout ${BENCH_TIMEOUT:-330} python3 bench/gated_bench.py --out $OUT $BENCH_ARGS 2>&1 | tee $OUT/gated.log
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu tests/gpu -q -x ${TEST_ARGS:-} 2>&1 | tee $OUT/gpu_tests.log | tail -5
fi
if [ -n "$NCU" ]; then
  timeout 90 ncu --clock-control none -k regex:_gated_step_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section ComputeWorkloadAnalysis python3 bench/profile_gated.py $NCU > $OUT/ncu.txt 2>&1
  grep -E "Registers|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|Memory Throughput|Duration|Warp Cycles Per Issued|Block Limit" $OUT/ncu.txt | head -20
fi
