# One device call (H200): bench, the gated GPU tests, optionally one ncu profile. Run from a checkout root that
# holds .gpu-vllm (carry it):  bash bench/device_gated.sh  (this tree), or with another tree copied under it,
# bash .scratch/kernels/bench/device_gated.sh (that tree's code runs: the script changes to its own tree).
# Env: BENCH_ARGS, BENCH_TIMEOUT, SKIP_BENCH, SKIP_TESTS, TEST_TIMEOUT, NCU_TIMEOUT, STEP_LAUNCHES (2; 1 for the one
# kernel), NCU ("fp32 4 64 '{json config}'"),
# NCU_SOURCE (the same arguments: a full profile with per-instruction stall samples, ncu_source.csv).
set -o pipefail
source .gpu-vllm/device-setup.sh
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH
python3 -c "import vllm_treewy.kernels.triton.gated as g; print('kernel from', g.__file__)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
  --format=csv > $OUT/smi.txt 2>&1
if [ -z "$SKIP_BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-200} python3 bench/gated_bench.py --out $OUT ${BENCH_ARGS:-} 2>&1 | tee $OUT/gated.log | \
    grep -E "^tune|^\| |done in|Error|error" | cut -c1-220
fi
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-90} python3 -m pytest -m gpu tests/gpu -k gated -q -p no:cacheprovider 2>&1 | \
    tee $OUT/gpu_tests.log | tail -5
fi
# bench/profile_gated.py launches 4 verify-only steps (the slot sets' previous step), then 4 fused ones; a step is
# STEP_LAUNCHES kernel launches (2 where the launch is the state pass and the row epilogue, the defaults up to 8
# nodes; 1 for the one kernel): skip 6 steps' launches, so the profiled ones are a fused step's with its states out
# of L2
STEP_LAUNCHES=${STEP_LAUNCHES:-2}
NCU_STEP="-k regex:'_gated_step_kernel|_state_pass_kernel|_row_epilogue_kernel' --launch-skip $((6 * STEP_LAUNCHES)) \
  --launch-count $STEP_LAUNCHES"
if [ -n "$NCU" ]; then
  eval "timeout ${NCU_TIMEOUT:-60} ncu --clock-control none $NCU_STEP \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section ComputeWorkloadAnalysis python3 bench/profile_gated.py $NCU" > $OUT/ncu.txt 2>&1
  grep -E "Registers Per|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|Duration|Warp Cycles Per Issued" \
    $OUT/ncu.txt | head -12
fi
if [ -n "$NCU_SOURCE" ]; then
  # where the warps stall, per SASS instruction (the source page of a full profile, as CSV): same launch as NCU's
  eval "timeout ${NCU_TIMEOUT:-60} ncu --clock-control none $NCU_STEP \
    --set full --import-source yes -f -o $OUT/gated_source python3 bench/profile_gated.py $NCU_SOURCE" \
    > $OUT/ncu_source.log 2>&1
  ncu -i $OUT/gated_source.ncu-rep --page source --csv --print-source sass > $OUT/ncu_source.csv 2>>$OUT/ncu_source.log
  ls -la $OUT/gated_source.ncu-rep $OUT/ncu_source.csv; tail -3 $OUT/ncu_source.log
fi
