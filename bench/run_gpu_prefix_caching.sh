#!/usr/bin/env bash
# Prefix caching of GDN states with reconstruct, store_all and no speculation (bench/gpu_prefix_caching.py), every
# engine at once, judged by the no-speculation engine without prefix caching; and the README's `vllm serve` command.
# Usage, from the checkout root on the H200 after `source .gpu-vllm/device-setup.sh`:
#   bash bench/run_gpu_prefix_caching.sh OUT_DIR [args for every engine]      e.g. ... $OUT --dtype float16
# RUNS (default "reconstruct store_all none reconstruct:dense") picks the runs, each STRATEGY[:dense][:v1] (v1: forced
# onto the V1 runner, e.g. "reconstruct::v1"; otherwise the runner vLLM picks, V2 on CUDA, which the reference expects
# of reconstruct: EXPECT_RUNNER, default V2, or V1 / any); SERVE=0 skips the serve check, KERNEL_TEST=0 the compiled
# boundary-kernel test (tests/gpu/test_boundary_states_gpu.py, log: kernel_test.log). DRY_RUN=1 starts nothing: every
# process checks and prints its arguments (--dry-run), on any machine.
# KV_BYTES (default 8 GiB) is each engine's fixed KV cache, GPU_UTIL (default 0.08) its start-up memory check; every
# process runs under `timeout ${CALL_LIMIT_S:-520}`. OUT_DIR gets log.txt (the summary lines), gpu_prefix_caching.json
# (the reference's report), serve.json and engines.tar.gz (every engine's log and run JSON).
set -u
out=$1; shift
work=${WORK:-/tmp/prefix-caching}
runs_list=${RUNS:-reconstruct store_all none reconstruct:dense}
rm -rf "$work"; mkdir -p "$out" "$work/runs" "$work/logs"
log=$out/log.txt; : >"$log"
start=$(date +%s)
limit=${CALL_LIMIT_S:-520}
dry=()
if [ "${DRY_RUN:-0}" = 1 ]; then
  dry=(--dry-run); KERNEL_TEST=0
else
  # the fixtures (and the long-context copy) and vLLM's model-info cache first: the engines would write them at once
  python3 -c "from bench import gpu_site; from bench.gpu_vllm_e2e import prompts_and_model, long_context_model; gpu_site.seed_model_info_cache(); long_context_model(prompts_and_model()[0])" >"$work/logs/fixture.log" 2>&1
  echo "=== fixture rc=$? at $(( $(date +%s) - start )) s" >>"$log"
fi
common=(--kv-cache-memory-bytes "${KV_BYTES:-8589934592}" --gpu-memory-utilization "${GPU_UTIL:-0.08}")
pids=() n=0
for r in $runs_list; do
  IFS=: read -r strategy dense runner <<<"$r"
  case "$dense:$runner" in :|dense:|:v1|dense:v1) ;; *) echo "RUNS entry $r: STRATEGY[:dense][:v1]" >&2; exit 2;; esac
  name=$strategy${dense:+-$dense}${runner:+-$runner}
  VLLM_CACHE_ROOT=$work/cache-$name timeout "$limit" python3 bench/gpu_prefix_caching.py spec --strategy "$strategy" \
    ${dense:+--dense} ${runner:+--runner "$runner"} --runs "$work/runs" "${common[@]}" "${dry[@]}" "$@" \
    >"$work/logs/$name.log" 2>&1 &
  pids+=($!); n=$((n + 1)); echo "=== $name started at $(( $(date +%s) - start )) s" >>"$log"; [ ${#dry[@]} = 1 ] || sleep 3
done
VLLM_CACHE_ROOT=$work/cache-reference timeout "$limit" python3 bench/gpu_prefix_caching.py reference \
  --runs "$work/runs" --expect "$n" --out "$out/gpu_prefix_caching.json" --expect-reconstruct-runner "${EXPECT_RUNNER:-V2}" \
  --command "RUNS='$runs_list' bash bench/run_gpu_prefix_caching.sh \$OUT $*" "${common[@]}" "${dry[@]}" "$@" \
  >"$work/logs/reference.log" 2>&1 &
pids+=($!); echo "=== reference started at $(( $(date +%s) - start )) s" >>"$log"
if [ "${KERNEL_TEST:-1}" = 1 ]; then  # the boundary kernel compiled, against its twin (tests/gpu)
  timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_boundary_states_gpu.py \
    >"$out/kernel_test.log" 2>&1 &
  pids+=($!); echo "=== kernel test started at $(( $(date +%s) - start )) s" >>"$log"
fi
if [ "${SERVE:-1}" = 1 ]; then
  VLLM_CACHE_ROOT=$work/cache-serve timeout "$limit" python3 bench/gpu_prefix_caching.py serve-check \
    --out "$out/serve.json" --kv-cache-memory-bytes 4294967296 --gpu-memory-utilization "${GPU_UTIL:-0.08}" \
    "${dry[@]}" "$@" \
    >"$work/logs/serve.log" 2>&1 &
  pids+=($!); echo "=== serve check started at $(( $(date +%s) - start )) s" >>"$log"
fi
for pid in "${pids[@]}"; do wait "$pid"; rc=$?; echo "=== pid $pid rc=$rc at $(( $(date +%s) - start )) s" >>"$log"; done
tar czf "$out/engines.tar.gz" -C "$work" logs runs
grep -hE "Using V2 Model Runner|Model Runner V2 does not|model runner instead|Mamba cache mode|Maximum concurrency| started | done |FAILED|batch [0-9]+|turn|hit rate|GDN pages|hit rates|runners:|ran on|arguments|PASS|FAIL|SERVE|Traceback|Error" \
  "$work"/logs/*.log | cut -c1-400 >>"$log"
tail -n 3 "$out/kernel_test.log" 2>/dev/null | sed 's/^/kernel test: /' >>"$log"
grep -E "^===|PASS|FAIL|SERVE|Traceback|Error|batch [0-9]+|turn|GDN pages|hit rates|runners:|ran on|arguments|started |kernel test" "$log" | cut -c1-400 | tail -80
