#!/usr/bin/env bash
# Draft trees against chains at a real shape with synthetic acceptance (bench/e2e/tree_real_shapes.py), one engine per
# process, in turn, in one device call; then the report over everything OUT_DIR holds (earlier calls' engines too).
# Usage, from the checkout root on the H200 after `source .gpu-vllm/device-setup.sh`:
#   SHAPE=qwen35-27b LAYERS=16 ENGINES="tree221 k3-code" BATCHES="1 2 4 8" \
#     bash bench/e2e/run_tree_real_shapes.sh OUT_DIR
# ENGINES: tree221 tree322 tree2221 tree3221 (each serves every profile and sibling rate through its requests' extra
# arguments), tree221-auto ... tree3221-auto (draft_tree_max_batch_size "auto": one class an engine, the first of
# --profiles and --sibling-rates) and k1-code k1-prose k3-code k3-prose k4-code k4-prose (vLLM's synthetic chain: one profile an engine;
# reconstruct, or store_all with -store_all appended, e.g. "k1-code k1-code-store_all"). SHAPE: a shape of
# bench/sweep/models.py or "fixture" (the CPU dry run); LAYERS: the shape cut to that many layers (a multiple of 4;
# empty: all); BATCHES (default 1 2 4 8 16 32 64); ATTN_BACKEND (default: vLLM's pick, FLASH_ATTN on Hopper, for
# trees and chains alike; TRITON_ATTN names Triton's); MAX_TOKENS (128), PROMPT_LEN (256), GPU_UTIL (0.9);
# CALL_LIMIT_S (570): an engine that would start with less than MIN_ENGINE_S (240) left is skipped and logged.
# Arguments after OUT_DIR go to every engine, e.g. `--profiles code --sibling-rates 0.4 --profile-batch 1 8`: one
# class, then a profiled generate per batch size (GPU kernel time by kind per engine step, in ENGINE.json).
# OUT_DIR gets ENGINE.json per engine (points, command, device facts, the runner and graphs vLLM used), log.txt,
# logs-HHMMSS.tar.gz and report.{json,csv,md} (tree / chain tokens/s, step-time ratio, break-even sibling rate per B).
set -u
out=$1; shift
mkdir -p "$out/logs"
log=$out/log.txt
start=$(date +%s)
limit=${CALL_LIMIT_S:-570}
echo "=== $(date -u +%FT%TZ) SHAPE=${SHAPE:-qwen35-27b} LAYERS=${LAYERS:-} ENGINES='${ENGINES:-}'" \
  "BATCHES='${BATCHES:-}' ATTN_BACKEND=${ATTN_BACKEND:-vllm-default} $*" >>"$log"
layers=(); [ -n "${LAYERS:-}" ] && layers=(--layers "$LAYERS")
backend=(); [ -n "${ATTN_BACKEND:-}" ] && backend=(--attention-backend "$ATTN_BACKEND")
for engine in ${ENGINES:-tree221 k3-code}; do
  strategy=reconstruct chain=$engine
  [[ $engine == *-store_all ]] && strategy=store_all chain=${engine%-store_all}
  case $chain in
    tree221|tree322|tree2221|tree3221) [ "$strategy" = reconstruct ] || chain=invalid
                                       name=$chain profiles=(--profiles code prose) ;;
    tree221-auto|tree322-auto|tree2221-auto|tree3221-auto) [ "$strategy" = reconstruct ] || chain=invalid
                                       name=${chain%-auto} profiles=(--shape-choice auto) ;;
    k1-code|k1-prose|k3-code|k3-prose|k4-code|k4-prose) name=${chain%-*} profiles=(--profiles "${chain#*-}") ;;
    *) chain=invalid ;;
  esac
  if [ "$chain" = invalid ]; then
    echo "unknown engine $engine (tree221 tree322 tree2221 tree3221, each with -auto, k1-code k1-prose k3-code k3-prose k4-code" \
      "k4-prose; a chain with -store_all appended runs store_all)" >&2
    exit 2
  fi
  left=$(( limit - ($(date +%s) - start) ))
  if [ "$left" -lt "${MIN_ENGINE_S:-240}" ]; then
    echo "=== skipped $engine (time: ${left} s left) at $(( $(date +%s) - start )) s" >>"$log"; continue
  fi
  echo "=== $engine started at $(( $(date +%s) - start )) s" >>"$log"
  timeout "$left" python3 -m bench.e2e.tree_real_shapes engine --name "$name" --strategy "$strategy" "${profiles[@]}" \
    --shape "${SHAPE:-qwen35-27b}" "${layers[@]}" --batches ${BATCHES:-1 2 4 8 16 32 64} \
    "${backend[@]}" --max-tokens "${MAX_TOKENS:-128}" \
    --prompt-len "${PROMPT_LEN:-256}" --gpu-memory-utilization "${GPU_UTIL:-0.9}" --out "$out" "$@" \
    >"$out/logs/$engine.log" 2>&1
  rc=$?; echo "=== $engine rc=$rc at $(( $(date +%s) - start )) s" >>"$log"
  grep -hE "tokens/s, step|^staggered | per step: |^[A-Za-z]*(Error|Exception)|^Traceback" "$out/logs/$engine.log" | cut -c1-300 >>"$log"
done
python3 -m bench.e2e.tree_real_shapes report --out "$out" >"$out/logs/report.log" 2>&1
echo "=== report rc=$? at $(( $(date +%s) - start )) s" >>"$log"
tar czf "$out/logs-$(date -u +%H%M%S).tar.gz" -C "$out" logs && rm -rf "$out/logs"  # a call's own (folders merge)
tail -60 "$log"
