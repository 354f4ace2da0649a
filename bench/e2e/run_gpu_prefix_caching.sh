#!/usr/bin/env bash
# Prefix caching of GDN states with reconstruct (MTP chains and draft trees), store_all and no speculation
# (bench/e2e/gpu_prefix_caching.py), every engine at once, judged by the no-speculation engine without prefix caching;
# and the README's two `vllm serve` commands (chain and tree).
# Usage, from the checkout root on the H200 after `source .gpu-vllm/device-setup.sh`:
#   bash bench/e2e/run_gpu_prefix_caching.sh OUT_DIR [args for every engine]      e.g. ... $OUT --dtype float16
# RUNS (default "reconstruct store_all none reconstruct:dense reconstruct::221 reconstruct:dense:221") picks the runs,
# each STRATEGY followed by any of, in any order, ":dense" (every boundary state kept; the two-turn chats), ":v1"
# (forced onto the V1 runner; otherwise the runner vLLM picks, V2 on CUDA, which the reference expects of reconstruct:
# EXPECT_RUNNER, default V2, or V1 / any) and ":WIDTHS", digits, one per tree level (221: draft_tree_widths [2,2,1],
# reconstruct only, on the fixture's blurred-MTP variant); empty fields are skipped ("reconstruct::221" is
# "reconstruct:221"). A bad entry (e.g. "store_all:221": the plugin refuses store_all trees on GPU) exits 2 before
# anything starts. SERVE (default "chain tree"; 0 or "" for none) picks the serve checks: chain, the README's first
# command (serve.json), tree, its second (serve_tree.json); KERNEL_TEST=0 skips the compiled boundary-kernel test
# (tests/gpu/test_boundary_states_gpu.py, log: kernel_test.log). DRY_RUN=1 starts nothing: every process checks and
# prints its arguments (--dry-run), on any machine.
# KV_BYTES (default 8 GiB) is each engine's fixed KV cache (4 GiB per serve check), GPU_UTIL (default 0.08) its
# start-up memory check; every process runs under `timeout ${CALL_LIMIT_S:-520}`. OUT_DIR gets log.txt (the summary
# lines), gpu_prefix_caching.json (the reference's report), serve*.json and engines.tar.gz (every engine's log and
# run JSON).
set -u
out=$1; shift
work=${WORK:-/tmp/prefix-caching}
runs_list=${RUNS:-reconstruct store_all none reconstruct:dense reconstruct::221 reconstruct:dense:221}
serve_list=${SERVE-chain tree}; [ "$serve_list" = 0 ] && serve_list=""; [ "$serve_list" = 1 ] && serve_list=chain
# every entry checked before anything starts: name|spec arguments
entries=() trees=0
for r in $runs_list; do
  IFS=: read -r -a fields <<<"$r"
  strategy=${fields[0]} dense="" runner="" widths=""
  for f in "${fields[@]:1}"; do
    case "$f" in
      "") ;;
      dense) [ -z "$dense" ] || { echo "RUNS entry $r: dense twice" >&2; exit 2; }; dense=dense;;
      v1) [ -z "$runner" ] || { echo "RUNS entry $r: v1 twice" >&2; exit 2; }; runner=v1;;
      *[!1-9]*) echo "RUNS entry $r: '$f' is none of dense, v1, WIDTHS (digits 1-9, e.g. 221); each entry is" \
                  "STRATEGY[:dense][:v1][:WIDTHS]" >&2; exit 2;;
      *) [ -z "$widths" ] || { echo "RUNS entry $r: two trees" >&2; exit 2; }; widths=$f;;
    esac
  done
  case "$strategy" in
    reconstruct|store_all|none) ;;
    *) echo "RUNS entry $r: STRATEGY is reconstruct, store_all or none" >&2; exit 2;;
  esac
  if [ -n "$widths" ] && [ "$strategy" != reconstruct ]; then
    echo "RUNS entry $r: draft trees ($widths) run with reconstruct only (the plugin refuses store_all trees on GPU;" \
      "none drafts nothing)" >&2; exit 2
  fi
  name=$strategy${widths:+-tree$widths}${dense:+-dense}${runner:+-$runner}
  tree_args=""
  [ -n "$widths" ] && { tree_args="--tree-widths $(echo "$widths" | sed 's/./& /g')--blurred-mtp"; trees=1; }
  entries+=("$name|--strategy $strategy${dense:+ --dense}${runner:+ --runner $runner}${tree_args:+ $tree_args}")
done
for mode in $serve_list; do
  case "$mode" in chain|tree) ;; *) echo "SERVE: '$mode' is none of chain, tree (or 0)" >&2; exit 2;; esac
done
rm -rf "$work"; mkdir -p "$out" "$work/runs" "$work/logs"
log=$out/log.txt; : >"$log"
start=$(date +%s)
limit=${CALL_LIMIT_S:-520}
dry=()
if [ "${DRY_RUN:-0}" = 1 ]; then
  dry=(--dry-run); KERNEL_TEST=0
else
  # the fixtures (and the long-context copy) and vLLM's model-info cache first: the engines would write them at once
  # (and, for tree runs, the blurred-MTP variant's long-context copy: the fixture's target weights, another MTP head)
  python3 -c "import argparse, sys; from bench.e2e import gpu_site; from bench.e2e.gpu_vllm_e2e import prompts_and_model, long_context_model, tree_model; gpu_site.seed_model_info_cache(); long_context_model(prompts_and_model()[0]); sys.argv[1] == '1' and long_context_model(tree_model(argparse.Namespace(blurred_mtp=True))[0])" "$trees" >"$work/logs/fixture.log" 2>&1
  echo "=== fixture rc=$? at $(( $(date +%s) - start )) s" >>"$log"
fi
common=(--kv-cache-memory-bytes "${KV_BYTES:-8589934592}" --gpu-memory-utilization "${GPU_UTIL:-0.08}")
pids=() n=0
for e in "${entries[@]}"; do
  IFS='|' read -r name spec_args <<<"$e"
  # shellcheck disable=SC2086
  VLLM_CACHE_ROOT=$work/cache-$name timeout "$limit" python3 bench/e2e/gpu_prefix_caching.py spec $spec_args \
    --runs "$work/runs" "${common[@]}" "${dry[@]}" "$@" >"$work/logs/$name.log" 2>&1 &
  pids+=($!); n=$((n + 1)); echo "=== $name started at $(( $(date +%s) - start )) s" >>"$log"; [ ${#dry[@]} = 1 ] || sleep 3
done
VLLM_CACHE_ROOT=$work/cache-reference timeout "$limit" python3 bench/e2e/gpu_prefix_caching.py reference \
  --runs "$work/runs" --expect "$n" --out "$out/gpu_prefix_caching.json" \
  --expect-reconstruct-runner "${EXPECT_RUNNER:-V2}" \
  --command "RUNS='$runs_list' SERVE='$serve_list' bash bench/e2e/run_gpu_prefix_caching.sh \$OUT $*" \
  "${common[@]}" "${dry[@]}" "$@" \
  >"$work/logs/reference.log" 2>&1 &
pids+=($!); echo "=== reference started at $(( $(date +%s) - start )) s" >>"$log"
if [ "${KERNEL_TEST:-1}" = 1 ]; then  # the boundary kernel compiled, against its twin (tests/gpu)
  timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_boundary_states_gpu.py \
    >"$out/kernel_test.log" 2>&1 &
  pids+=($!); echo "=== kernel test started at $(( $(date +%s) - start )) s" >>"$log"
fi
port=8321
for mode in $serve_list; do  # chain: serve.json; tree: serve_tree.json (each its own port)
  suffix=""; tree=(); [ "$mode" = tree ] && { suffix=_tree; tree=(--tree); }
  VLLM_CACHE_ROOT=$work/cache-serve$suffix timeout "$limit" python3 bench/e2e/gpu_prefix_caching.py serve-check \
    "${tree[@]}" --out "$out/serve$suffix.json" --port "$port" --kv-cache-memory-bytes 4294967296 \
    --gpu-memory-utilization "${GPU_UTIL:-0.08}" "${dry[@]}" "$@" >"$work/logs/serve$suffix.log" 2>&1 &
  pids+=($!); echo "=== serve check ($mode) started at $(( $(date +%s) - start )) s" >>"$log"; port=$((port + 1))
done
for pid in "${pids[@]}"; do wait "$pid"; rc=$?; echo "=== pid $pid rc=$rc at $(( $(date +%s) - start )) s" >>"$log"; done
tar czf "$out/engines.tar.gz" -C "$work" logs runs
grep -hE "Using V2 Model Runner|Model Runner V2 does not|model runner instead|Mamba cache mode|Maximum concurrency| started | done |FAILED|batch [0-9]+|turn|hit rate|GDN pages|hit rates|runners:|trees:|ran on|failed:|arrived|arguments| run |command|PASS|FAIL|SERVE|Traceback|Error|error:" \
  "$work"/logs/*.log | cut -c1-400 >>"$log"
tail -n 3 "$out/kernel_test.log" 2>/dev/null | sed 's/^/kernel test: /' >>"$log"
grep -E "^===|PASS|FAIL|SERVE|Traceback|Error|error:|batch [0-9]+|turn|GDN pages|hit rates|runners:|trees:|ran on|failed:|arrived|arguments| run |command|started |kernel test" "$log" | cut -c1-400 | tail -100
