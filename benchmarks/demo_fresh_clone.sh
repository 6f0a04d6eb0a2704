#!/usr/bin/env bash
# Time the README's first command from a fresh clone in a fresh virtual environment with an empty model
# cache: install, then `specheads demo` (pass --quick to time the small version).
#   bash benchmarks/demo_fresh_clone.sh [--quick]    (results: docs/benchmarks.md)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
git clone -q "$repo" "$work/specheads"
cd "$work/specheads"
export SPECHEADS_CACHE="$work/cache"
start=$(date +%s)
python3 -m venv .venv && . .venv/bin/activate && sh scripts/install.sh > "$work/install.log" 2>&1
installed=$(date +%s)
specheads demo "$@"
done_at=$(date +%s)
echo "install: $((installed - start)) s; specheads demo $*: $((done_at - installed)) s; total: $((done_at - start)) s"
echo "(clone, venv and demo folder left in $work)"
