#!/usr/bin/env bash
# Reconstruct MTP chains on Model Runner V2 (vLLM's default on CUDA) beside store_all on V2 (and optionally reconstruct
# forced onto V1), judged against no speculation: every engine at once, timed in turn (bench/e2e/gpu_v2_chains.py).
# Usage, from the checkout root on the H200 after `source .gpu-vllm/device-setup.sh`:
#   bash bench/e2e/run_gpu_v2_chains.sh OUT_DIR "ENGINES" [args for every engine]
#   ENGINES: STRATEGY:K[:v1][@BACKEND] separated by spaces (v1: forced onto the V1 runner; BACKEND: the engine's
#            attention backend, default vLLM's pick, FLASH_ATTN on the H200, or $ATTENTION_BACKEND for the call), e.g.
#            "reconstruct:3 store_all:3 reconstruct:1 store_all:1 reconstruct:3:v1 reconstruct:3@TRITON_ATTN"
#   e.g.  bash bench/e2e/run_gpu_v2_chains.sh $OUT "reconstruct:3 store_all:3" --dtype float16
# KV_BYTES (default 12 GiB) is each engine's fixed KV cache (store_all k = 3 needs ~9 GiB for B = 256 on the
# fixture); GPU_UTIL (default 0.1) its start-up memory check. Each engine runs under `timeout ${CALL_LIMIT_S:-540}`.
# OUT_DIR gets three files: log.txt (the summary lines), gpu_v2_chains.json (the reference's report) and
# engines.tar.gz (every engine's log and run JSON); the working folders stay in ${WORK:-/tmp/v2-chains}.
# FIXTURE_ARCH (default qwen3_5) is the fixture's model class for every engine: qwen3_next builds the Qwen3-Next
# fixture (same shape, its own folder). The GDN state's dtype is an argument for every engine: --ssm-cache-dtype
# float32 (the default) / bfloat16 / auto (vLLM's: the activation dtype on Qwen3-Next).
#   DRY_RUN=1 bash bench/e2e/run_gpu_v2_chains.sh OUT_DIR "ENGINES" [args]   # prints each engine's run, fixture
#                                                                           # folder and CUDA engine kwargs only
set -u
out=$1; engines=$2; shift 2
work=${WORK:-/tmp/v2-chains}
rm -rf "$work"; mkdir -p "$out" "$work/runs" "$work/turns" "$work/logs"
log=$out/log.txt; : >"$log"
start=$(date +%s)
n=$(( $(wc -w <<<"$engines") + 1 ))
limit=${CALL_LIMIT_S:-540}
arch=${FIXTURE_ARCH:-qwen3_5}
common=(--kv-cache-memory-bytes "${KV_BYTES:-12884901888}" --gpu-memory-utilization "${GPU_UTIL:-0.1}"
        --turns-dir "$work/turns" --engines "$n" --fixture-architecture "$arch")
# spec_args ENGINE: the driver's arguments for one engine name (STRATEGY:K[:v1][@BACKEND]), in the array `spec`
spec_args() {
  local e=$1 backend= strategy k runner
  [[ $e == *@* ]] && backend=${e#*@} && e=${e%@*}
  IFS=: read -r strategy k runner <<<"$e"
  name=$strategy-k$k${runner:+-$runner}${backend:+-$backend}
  spec=(spec --strategy "$strategy" --k "$k" --runner "${runner:-default}" ${backend:+--attention-backend "$backend"})
}
if [ -n "${DRY_RUN:-}" ]; then  # every process's arguments, parsed by the driver's parser in one Python
  calls=() turn=0
  for e in $engines; do
    spec_args "$e"
    calls+=("$(printf '%q ' "$name" "${spec[@]}" --runs R --turn "$turn" "${common[@]}" "$@")")
    turn=$((turn + 1))
  done
  calls+=("$(printf '%q ' reference reference --runs R --expect $((n - 1)) --out O --turn "$turn" "${common[@]}" "$@")")
  python3 -c 'import sys; from bench.e2e import gpu_v2_chains as g; g.print_dry_runs(sys.argv[1:])' "${calls[@]}" \
    || exit 1
  exit 0
fi
# the fixture and vLLM's model-info cache first: the engines would otherwise write them at once
python3 -c "from bench.e2e import gpu_site; from bench.e2e.gpu_vllm_e2e import prompts_and_model; gpu_site.seed_model_info_cache(); prompts_and_model('$arch')" >"$work/logs/fixture.log" 2>&1
rc=$?; echo "=== fixture rc=$rc at $(( $(date +%s) - start )) s" >>"$log"
turn=0 pids=()
for e in $engines; do
  spec_args "$e"
  # each engine its own vLLM cache (its compile artifacts; engines of one config hash would write the same files)
  VLLM_CACHE_ROOT=$work/cache-$name timeout "$limit" python3 bench/e2e/gpu_v2_chains.py "${spec[@]}" \
    --runs "$work/runs" --turn "$turn" "${common[@]}" "$@" >"$work/logs/$name.log" 2>&1 &
  pids+=($!); echo "=== $name (turn $turn) started at $(( $(date +%s) - start )) s" >>"$log"
  turn=$((turn + 1)); sleep 4
done
VLLM_CACHE_ROOT=$work/cache-reference timeout "$limit" python3 bench/e2e/gpu_v2_chains.py reference --runs "$work/runs" \
  --expect $((n - 1)) --out "$out/gpu_v2_chains.json" --turn "$turn" "${common[@]}" \
  --command "FIXTURE_ARCH='$arch' bash bench/e2e/run_gpu_v2_chains.sh \$OUT \"$engines\" $*" "$@" \
  >"$work/logs/reference.log" 2>&1 &
pids+=($!); echo "=== reference (turn $turn) started at $(( $(date +%s) - start )) s" >>"$log"
for pid in "${pids[@]}"; do wait "$pid"; rc=$?; echo "=== pid $pid rc=$rc at $(( $(date +%s) - start )) s" >>"$log"; done
tar czf "$out/engines.tar.gz" -C "$work" logs runs
grep -hE "Using V2 Model Runner|Model Runner V2 does not|model runner instead|Capturing CUDA graphs|cudagraph_mode|GDN spec decode|Maximum concurrency|Using [A-Z_]+ attention backend|backend out of| started | done |batch [0-9]+|beside|runs on V2|PASS|FAIL|Traceback|Error" \
  "$work"/logs/*.log | cut -c1-300 >>"$log"
grep -E "^===|runs on V2|PASS|FAIL|Traceback|Error|beside|batch [0-9]+:" "$log" | cut -c1-300 | tail -80
