#!/usr/bin/env bash
# The device command behind bench/results/gpu_vllm_e2e (one engine per process; the reference judges last).
# Usage, from the checkout root on the H200:  bash bench/e2e/run_gpu_vllm_e2e.sh OUT_DIR "KS" [extra args]
# e.g.  bash bench/e2e/run_gpu_vllm_e2e.sh $OUT "3 1"      or      bash bench/e2e/run_gpu_vllm_e2e.sh $OUT 3 --eager
# Device time: the call's limit is CALL_LIMIT_S (default 560: a `timeout 560` around it); a speculative run after
# the first starts only if RUN_S (one engine's start and runs, default 150) and REFERENCE_S (the reference and its
# verdicts, default 170) still fit, so the verdicts always come back. A failed reconstruct run ends the call.
# STRATEGIES (default "reconstruct store_all") picks the speculative runs, e.g. STRATEGIES=store_all with a cut
# call's reconstruct runs copied into OUT/runs, so that the reference judges both.
set -u
out=$1; ks=$2; shift 2
# Per-engine results under $OUT too: they come back even when the call runs out of time before the reference,
# which judges every run under $OUT/runs (copy a cut call's runs there to judge them in the next one).
log=$out/log.txt runs=$out/runs
start=$(date +%s) first=1
for k in $ks; do
  for s in ${STRATEGIES:-reconstruct store_all}; do
    elapsed=$(( $(date +%s) - start ))
    if [ "$first" = 0 ] && [ $(( elapsed + ${RUN_S:-150} + ${REFERENCE_S:-170} )) -gt "${CALL_LIMIT_S:-560}" ]; then
      echo "=== skipped $s k=$k (time)" >>"$log"; continue
    fi
    echo "=== $s k=$k at $elapsed s" >>"$log"; first=0
    python3 bench/e2e/gpu_vllm_e2e.py spec --strategy "$s" --k "$k" --runs "$runs" "$@" >>"$log" 2>&1
    rc=$?
    echo "=== rc=$rc" >>"$log"
    if [ "$rc" != 0 ] && [ "$s" = reconstruct ]; then  # nothing to judge: keep the device time
      grep -E "Error|error|Assert" "$log" | tail -20; exit 1
    fi
  done
done
echo "=== reference at $(( $(date +%s) - start )) s" >>"$log"
python3 bench/e2e/gpu_vllm_e2e.py reference --runs "$runs" --out "$out/gpu_vllm_e2e.json" \
  --command "bash bench/e2e/run_gpu_vllm_e2e.sh \$OUT \"$ks\" $*" "$@" >>"$log" 2>&1
echo "=== rc=$? at $(( $(date +%s) - start )) s" >>"$log"
grep -E "^===|tokens/s|us/token|beside store_all|smaller batches|batch [0-9]+:|PASS|FAIL|k[0-9]+ done|Traceback|Error|cudagraph_mode|Capturing CUDA graphs|GDN spec decode|Maximum concurrency|no-spec|-k[0-9] \{" "$log" | cut -c1-300 | tail -90
