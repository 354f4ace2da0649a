#!/usr/bin/env bash
# MTP draft trees on Model Runner V2 (vllm_plugin/v2/runner.py, drafting levels in CUDA graphs), in one device
# command: the chosen engines start at once (bench/e2e/gpu_v2_chains.py's turns: starts overlap, timings do not), on the
# fixture's blurred-MTP variant (its head right about half the time, so trees branch usefully):
#   fp16 trees, judged tie-aware against no speculation (fp16) at every batch size (one timed pass each: their
#     outputs are what is judged);
#   bf16 trees and chains, tokens/s (median of 3 passes) and acceptance length, reported, not judged against the fp16
#     reference: a tree beside the chain of its depth in the same call.
# The no-speculation reference times one pass and skips its control in smaller batches (the Qwen3.5 fixture's fp16
# floor, PASS in the first call) unless SHAPE_CONTROL=1 (a fixture whose floor no call has shown yet). Each run records the runner vLLM picked ("model_runner"): V2 expected for every engine.
# Usage, from the checkout root on the H200 after `source .gpu-vllm/device-setup.sh`:
#   bash bench/e2e/run_gpu_v2_trees.sh OUT_DIR [args for every engine, e.g. --max-tokens 96, --staggered,
#     --profile-batch 1 8: after its timed passes, each engine profiles one generate per batch size in its turn]
#   DRY_RUN=1 bash bench/e2e/run_gpu_v2_trees.sh OUT_DIR   # prints the engine commands and checks their arguments only
# OUT_DIR gets log.txt (summary), gpu_v2_trees.json (the reference's report) and engines.tar.gz (every engine's log
# and run JSON). ENGINES (names from the catalog below) and BATCHES choose what runs; KV_BYTES (default 8 GiB) per
# engine, GPU_UTIL (0.1), CALL_LIMIT_S (480) per engine, STAGGER_S (1) between engine starts.
# Attention: vLLM's pick (FLASH_ATTN on the H200) for every engine and the reference; ATTENTION_BACKEND=TRITON_ATTN
# names one for the whole call, and every catalog name with "-triton" appended runs that engine on TRITON_ATTN
# beside the same engine on vLLM's pick (e.g. ENGINES="tree221-bf16 tree221-bf16-triton": tokens/s of both).
# FIXTURE_ARCH (default qwen3_5) is the fixture's model class for every engine and the reference: qwen3_next builds
# the Qwen3-Next fixture (same shape, its own folder). The GDN state's dtype is an engine argument for the whole
# call: --ssm-cache-dtype float32 (the default) / bfloat16 / auto (vLLM's: the activation dtype on Qwen3-Next), e.g.
#   FIXTURE_ARCH=qwen3_next SHAPE_CONTROL=1 ENGINES="k3-fp16 tree221-fp16" \
#     bash bench/e2e/run_gpu_v2_trees.sh OUT_DIR --ssm-cache-dtype bfloat16
# (two such calls at once, each its own WORK and OUT_DIR, judge both state dtypes in one device command).
set -u
out=$1; shift
work=${WORK:-/tmp/v2-trees}
rm -rf "$work"; mkdir -p "$out" "$work/runs" "$work/turns" "$work/logs"
log=$out/log.txt; : >"$log"
start=$(date +%s)
limit=${CALL_LIMIT_S:-480}
# The engine catalog: name -> engine arguments (the strategy is reconstruct unless the name says store_all). ENGINES picks the call's
# engines by name (default: the fp16 trees [2,2,1] and [2,1,1] and the bf16 tree [2,2,1]); BATCHES the batch sizes.
# fp16 engines are judged (one timed pass: their outputs are what is judged); bf16 ones report tokens/s (median of
# 3 passes) and acceptance beside the bf16 chains of the same depth (k3: depth 3, k2: depth 2 for [4,2], k4: depth 4
# for [3,2,2,1], k1: depth 1 for [4]; bench/results/mtp_tree_acceptance_cpu has their acceptance on CPU).
declare -A catalog
for w in 221 211 322 42 3221 4; do
  widths=$(echo "$w" | sed 's/./& /g')
  catalog[tree$w-fp16]="--tree-widths $widths--dtype float16 --blurred-mtp --name-suffix fp16 --timing-repeats 1"
  catalog[tree$w-bf16]="--tree-widths $widths--dtype bfloat16 --blurred-mtp --name-suffix bf16 --timing-repeats 3"
done
# draft_tree_max_batch_size 8: the [2,2,1] tree up to 8 requests, the chain of depth 3 above. With --staggered
# (for every engine: the reference generates the same lengths) each batch shrinks while it runs, so batches of 64 and
# 256 cross 8 (chain steps, then tree steps, a slot's commit crossing shapes).
for d in fp16 bf16; do
  catalog[tree221t8-$d]="${catalog[tree221-$d]} --tree-max-batch-size 8"
done
for k in 4 3 2 1; do
  catalog[k$k-bf16]="--k $k --dtype bfloat16 --blurred-mtp --name-suffix bf16 --timing-repeats 3"
done
# The chain of the [2,2,1] tree's depth, judged beside it (fp16, the same blurred head).
catalog[k3-fp16]="--k 3 --dtype float16 --blurred-mtp --name-suffix fp16 --timing-repeats 1"
# Depth 4: [3,2,2,1] verifies 1 + 33 tokens a request, 256 of them 8,704 tokens: a token budget of 16,384 holds a
# batch of 256 trees (and their graph); the chain of its depth runs with the same budget.
for name in tree3221-fp16 tree3221-bf16 k4-bf16; do
  catalog[$name]+=" --max-num-batched-tokens 16384"
done
# Sampled throughput (-t1: temperature 1.0, request i seeded i, as users run at temperature > 0): a tree's exact
# sampler accepts a child with the target's probability of its token, so its acceptance differs from greedy's
# (bench/results/mtp_tree_acceptance_cpu: on the fixture the trees gain less over the chain than under greedy).
for name in tree221-bf16 tree322-bf16 tree42-bf16 tree3221-bf16 k4-bf16 k3-bf16 k2-bf16; do
  catalog[$name-t1]="${catalog[$name]} --temperature 1.0 --name-suffix bf16-t1"
done
# A chain with "-store_all" appended runs vLLM's store_all on the same head, judged beside reconstruct (e.g. a GDN
# state dtype whose rounding the no-speculation reference does not share: ENGINES="k3-fp16 k3-fp16-store_all" with
# --ssm-cache-dtype bfloat16). The engine's later --strategy wins over the script's.
for name in k4-bf16 k3-bf16 k2-bf16 k1-bf16 k3-fp16; do
  catalog[$name-store_all]="${catalog[$name]} --strategy store_all"
done
for name in "${!catalog[@]}"; do
  catalog[$name-triton]="${catalog[$name]} --attention-backend TRITON_ATTN"
done
engines=()
for name in ${ENGINES:-tree221-fp16 tree211-fp16 tree221-bf16}; do
  [ -n "${catalog[$name]:-}" ] || { echo "unknown engine $name (catalog: ${!catalog[*]})" >&2; exit 2; }
  engines+=("$name|${catalog[$name]}")
done
batches=(--batch-sizes ${BATCHES:-1 8 64})
n=$(( ${#engines[@]} + 1 ))
arch=${FIXTURE_ARCH:-qwen3_5}
common=(--kv-cache-memory-bytes "${KV_BYTES:-8589934592}" --gpu-memory-utilization "${GPU_UTIL:-0.1}"
        --turns-dir "$work/turns" --engines "$n" "${batches[@]}" --fixture-architecture "$arch")
no_control=(--no-shape-control); [ -n "${SHAPE_CONTROL:-}" ] && no_control=()
if [ -n "${DRY_RUN:-}" ]; then  # every process's arguments, parsed by the driver's parser in one Python
  calls=()
  for e in "${engines[@]}"; do
    IFS='|' read -r name extra <<<"$e"
    # shellcheck disable=SC2086
    calls+=("$(printf '%q ' "$name" spec --strategy reconstruct --runs R --turn 0 $extra "${common[@]}" "$@")")
  done
  calls+=("$(printf '%q ' reference reference --runs R --expect $((n - 1)) --out O --turn $((n - 1)) --dtype float16 \
    --timing-repeats 1 "${no_control[@]}" "${common[@]}" --command C "$@")")
  python3 -c 'import sys; from bench.e2e import gpu_v2_chains as g; g.print_dry_runs(sys.argv[1:])' "${calls[@]}" \
    || exit 1
  exit 0
fi
# The fixture and its blurred-MTP variant, built once before the engines start (each engine would otherwise build
# its own copy: built_once is race-safe, but four builds compete for the CPU). On a warm machine they are in /tmp
# from an earlier call: no step (it costs ~19 s, mostly imports). The folders: gpu_vllm_e2e.fixture_dir.
fixture=/tmp/fixture-qwen35; [ "$arch" = qwen3_5 ] || fixture=$fixture-$arch
if [ -f "$fixture/fixture.json" ] && [ -f "$fixture-blurred-mtp/fixture.json" ]; then
  echo "=== fixture already built (warm machine) at $(( $(date +%s) - start )) s" >>"$log"
else
  python3 -c "from bench.e2e import gpu_site; from bench.e2e.gpu_vllm_e2e import tree_model; import argparse; gpu_site.seed_model_info_cache(); tree_model(argparse.Namespace(blurred_mtp=True, fixture_architecture='$arch'))" >"$work/logs/fixture.log" 2>&1
  rc=$?; echo "=== fixture rc=$rc at $(( $(date +%s) - start )) s" >>"$log"
fi
turn=0 pids=()
for e in "${engines[@]}"; do
  IFS='|' read -r name extra <<<"$e"
  # shellcheck disable=SC2086
  VLLM_CACHE_ROOT=$work/cache-$name timeout "$limit" python3 bench/e2e/gpu_v2_chains.py spec --strategy reconstruct \
    $extra --runs "$work/runs" --turn "$turn" "${common[@]}" "$@" >"$work/logs/$name.log" 2>&1 &
  pids+=($!); echo "=== $name (turn $turn) started at $(( $(date +%s) - start )) s" >>"$log"
  turn=$((turn + 1)); sleep "${STAGGER_S:-1}"
done
VLLM_CACHE_ROOT=$work/cache-reference timeout "$limit" python3 bench/e2e/gpu_v2_chains.py reference --runs "$work/runs" \
  --expect $((n - 1)) --out "$out/gpu_v2_trees.json" --turn "$turn" --dtype float16 --timing-repeats 1 \
  "${no_control[@]}" "${common[@]}" \
  --command "FIXTURE_ARCH='$arch' SHAPE_CONTROL='${SHAPE_CONTROL:-}' ENGINES='${ENGINES:-}' BATCHES='${BATCHES:-}' bash bench/e2e/run_gpu_v2_trees.sh \$OUT $*" "$@" >"$work/logs/reference.log" 2>&1 &
pids+=($!); echo "=== reference (turn $turn) started at $(( $(date +%s) - start )) s" >>"$log"
for pid in "${pids[@]}"; do wait "$pid"; rc=$?; echo "=== pid $pid rc=$rc at $(( $(date +%s) - start )) s" >>"$log"; done
echo "=== all engines done at $(( $(date +%s) - start )) s (target: 190 s)" >>"$log"
tar czf "$out/engines.tar.gz" -C "$work" logs runs
grep -hE "Using V2 Model Runner|Model Runner V2 does not|model runner instead|Capturing CUDA graphs|cudagraph_mode|Maximum concurrency|Using [A-Z_]+ attention backend|backend out of|FA3_AVAILABLE| started | done |batch [0-9]+|beside|runs on V2|PASS|FAIL|Traceback|Error" \
  "$work"/logs/*.log | cut -c1-300 >>"$log"
grep -E "^===|runs on V2|PASS|FAIL|Traceback|Error|beside|batch [0-9]+:| done " "$log" | cut -c1-300 | tail -80
