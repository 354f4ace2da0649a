#!/usr/bin/env bash
# The GPU suite in one device call: its tests split round-robin over N pytest processes on the one GPU (Triton's
# compiles, most of the suite's time, run on the host's cores side by side). Logs: DIR/shard_*.log; the exit status
# is the first failing shard's.
#   bash tests/gpu/run_sharded.sh DIR [N] [pytest selection args...]
set -u
dir=$1; shards=${2:-4}; shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$dir"
python3 -m pytest -m gpu tests/gpu --collect-only -q -p no:cacheprovider "$@" | grep '::' > "$dir/ids.txt"
split -n "r/$shards" -d "$dir/ids.txt" "$dir/ids_"
pids=()
# `timeout` signals this script only: take the shards down with it, or they run on into the next command
trap 'kill "${pids[@]}" 2>/dev/null; exit 124' TERM INT
for ids in "$dir"/ids_*; do
    python3 -m pytest -m gpu -q -p no:cacheprovider $(cat "$ids") > "$dir/shard_${ids##*_}.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
done
tail -qn 1 "$dir"/shard_*.log
exit "$status"
