#!/usr/bin/env bash
# Draft trees on the H200 (CUDA, TRITON_ATTN, the continuation test drafter): the no-speculation engine first (the
# drafter's truth, the reference outputs, no-spec tokens/s), then one engine per tree shape, then the report.
# Usage, from the checkout root:  bash bench/e2e/run_gpu_tree_e2e.sh OUT_DIR "WIDTHS..." [--concurrent] [extra args]
#   WIDTHS: shapes separated by spaces, levels by commas, e.g. "2,1,1 2,2,1 3,2,2 4,2"
#   --concurrent: the tree engines run at once (each with a fixed 4 GiB KV cache, no memory profiling, and a
#                 start-up memory check of 0.15 of the GPU), which fits four engine starts into one call; their
#                 tokens/s are then not throughput measurements.
# Extra args go to every engine (e.g. --batch-sizes 1 8 64 --max-tokens 64 --eager).
# First (unless TREE_GPU_TESTS=0) the bf16 tree attention tests: $OUT/gpu_tests.log. Not beside an engine: vLLM's
# start-up memory profile asserts that no other process frees GPU memory meanwhile (it failed so on 2026-12-01).
# PREEMPTION_SHAPES="2,2,1 ...": then, for those shapes, prompts that cross their attention block while decoding in a
# KV cache that preempts (`gpu_vllm_e2e.py preemption-continuations`, `tree --preemption`); their block sizes come
# from this call's tree runs or from the run folders or reports in BLOCK_SIZES_FROM; PREEMPTION_PROMPTS per tree
# (default 8). WIDTHS may then be "" (no standard runs).
set -u
out=$1; shapes=$2; shift 2
concurrent=0
if [ "${1:-}" = "--concurrent" ]; then concurrent=1; shift; fi
mkdir -p "$out/runs"
log=$out/log.txt
start=$(date +%s)
if [ "${TREE_GPU_TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -m gpu tests/gpu/test_tree_attention_gpu.py >"$out/gpu_tests.log" 2>&1
  echo "=== gpu tests at $(( $(date +%s) - start )) s: $(tail -1 "$out/gpu_tests.log")" >>"$log"
fi

# run_trees PREFIX SHAPES [tree args]: one engine per shape, at once with --concurrent
run_trees() {
  local prefix=$1 shapes=$2 pids="" shape widths name
  shift 2
  for shape in $shapes; do
    widths=${shape//,/ }
    name=${prefix}tree-${shape//,/x}
    if [ "$concurrent" = 1 ]; then
      echo "=== $name started at $(( $(date +%s) - start )) s (concurrent)" >>"$log"
      python3 bench/e2e/gpu_vllm_e2e.py tree --tree-widths $widths --out-dir "$out" --concurrent \
        --kv-cache-memory-bytes 4294967296 --gpu-memory-utilization 0.15 "$@" >"$out/$name.log" 2>&1 &
      pids="$pids $!"
      sleep 5  # engine starts a little apart
    else
      echo "=== $name at $(( $(date +%s) - start )) s" >>"$log"
      python3 bench/e2e/gpu_vllm_e2e.py tree --tree-widths $widths --out-dir "$out" "$@" >"$out/$name.log" 2>&1
      echo "=== $name rc=$? at $(( $(date +%s) - start )) s" >>"$log"
    fi
  done
  for pid in $pids; do wait "$pid"; echo "=== pid $pid rc=$? at $(( $(date +%s) - start )) s" >>"$log"; done
  cat "$out"/${prefix}tree-*.log >>"$log" 2>/dev/null
}

if [ -n "$shapes" ]; then
  echo "=== continuations at 0 s" >>"$log"
  python3 bench/e2e/gpu_vllm_e2e.py continuations --out-dir "$out" "$@" >>"$log" 2>&1
  echo "=== rc=$? at $(( $(date +%s) - start )) s" >>"$log"
  run_trees "" "$shapes" "$@"
fi
if [ -n "${PREEMPTION_SHAPES:-}" ]; then
  echo "=== preemption continuations at $(( $(date +%s) - start )) s" >>"$log"
  python3 bench/e2e/gpu_vllm_e2e.py preemption-continuations --out-dir "$out" --tree-shapes $PREEMPTION_SHAPES \
    --block-sizes-from "$out/runs" ${BLOCK_SIZES_FROM:-} ${PREEMPTION_PROMPTS:+--num-prompts $PREEMPTION_PROMPTS} \
    "$@" >>"$log" 2>&1
  echo "=== rc=$? at $(( $(date +%s) - start )) s" >>"$log"
  run_trees preempted- "$PREEMPTION_SHAPES" --preemption "$@"
fi
expected=""
for shape in $shapes; do expected="$expected tree-${shape//,/x}"; done
for shape in ${PREEMPTION_SHAPES:-}; do expected="$expected preempted-tree-${shape//,/x}"; done
python3 bench/e2e/gpu_vllm_e2e.py tree-report --out-dir "$out" --expected-runs $expected \
  --command "${PREEMPTION_SHAPES:+PREEMPTION_SHAPES=\"$PREEMPTION_SHAPES\" }${BLOCK_SIZES_FROM:+BLOCK_SIZES_FROM=\"$BLOCK_SIZES_FROM\" }bash bench/e2e/run_gpu_tree_e2e.sh \$OUT \"$shapes\" $( [ $concurrent = 1 ] && echo --concurrent ) $*" \
  >>"$log" 2>&1
echo "=== report rc=$? at $(( $(date +%s) - start )) s" >>"$log"
grep -E "^===|^tree-|^preempted-|preemptions|tokens/s|batch [0-9]+|PASS|FAIL|Traceback|Error|cudagraph_mode|Capturing CUDA graphs" "$log" \
  | cut -c1-300 | tail -90
