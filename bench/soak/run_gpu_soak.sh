#!/usr/bin/env bash
# The soak on the H200 in one device call: the README's reconstruct chain and [2,2,1] tree `vllm serve` commands (prefix
# caching on, the gpu-vllm site's backends), both servers at once on the one GPU, each driven for DURATION_S (default
# 300) at CONCURRENCY (default 128) in flight, the whole run bounded by DEADLINE_S (default 540: a start of up to
# ~290 s shortens the soak, never the checks). KV_BYTES (default 48 MiB: about 200 blocks of 176 tokens for the
# chain, 143 of 224 for the tree, whose GDN page holds the pseudo-value buffer) is each server's fixed KV cache, at
# this concurrency near full, so that long prompts can make vLLM preempt (counted in summary.json; 128 MiB never
# did), with MAX_NUM_SEQS (default CONCURRENCY) at most its GDN blocks (vLLM's FULL-graph start-up check); GPU_UTIL
# (default 0.08) its start-up memory check.
# Usage, from the checkout root after `source .gpu-vllm/device-setup.sh`:
#   bash bench/soak/run_gpu_soak.sh OUT_DIR [more bench.soak args] [-- more vllm serve args]
# OUT_DIR gets summary.json, console.txt and each strategy's server.log.
set -u
out=$1; shift
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0
python3 -m vllm_treewy.vllm_patches  # as `make install` does: the plugin's vLLM patches (the tree fallbacks counter)
concurrency=${CONCURRENCY:-128}
timeout "${CALL_LIMIT_S:-590}" python3 -m bench.soak --out "$out" --gpu --parallel \
  --duration-s "${DURATION_S:-300}" --deadline-s "${DEADLINE_S:-540}" --concurrency "$concurrency" \
  --requests "${REQUESTS:-200000}" --max-tokens "${MAX_TOKENS:-32}" --max-model-len "${MAX_MODEL_LEN:-2048}" \
  --kv-cache-memory-bytes "${KV_BYTES:-50331648}" --start-timeout-s 400 "$@" \
  -- --gpu-memory-utilization "${GPU_UTIL:-0.08}" --max-num-seqs "${MAX_NUM_SEQS:-$concurrency}" \
  2>&1 | tee "$out/console.txt"
exit "${PIPESTATUS[0]}"
