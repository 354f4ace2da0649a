#!/usr/bin/env bash
# CI as on a new machine: a fresh clone of this checkout's HEAD in a fresh venv with an empty pip cache, then
# `bash .ci/run` (or `make demo` with `demo` as 2nd argument); prints the wall time.
#   bash .ci/fresh_clone.sh NAME [demo]      (work folder: /tmp/fresh-NAME, log: /tmp/fresh-NAME/log)
# The clone, venv and pip cache (~3.3 GB) are removed afterwards, the log kept (KEEP=1 keeps them).
set -u
name=$1 target=${2:-ci}
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=/tmp/fresh-$name
rm -rf "$dir" && mkdir -p "$dir"
git clone -q "$repo" "$dir/repo" && python3 -m venv "$dir/venv" || exit 1
cd "$dir/repo"
if [ "$target" = demo ]; then cmd="make demo"; else cmd="bash .ci/run"; fi
start=$(date +%s)
PATH=$dir/venv/bin:$PATH PIP_CACHE_DIR=$dir/pip-cache CI=true $cmd >"$dir/log" 2>&1
rc=$?
echo "$name: '$cmd' at $(git rev-parse --short HEAD) rc=$rc wall=$(( $(date +%s) - start ))s"
cd /
[ "${KEEP:-0}" = 1 ] || rm -rf "$dir/repo" "$dir/venv" "$dir/pip-cache"
exit $rc
