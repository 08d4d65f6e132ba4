#!/usr/bin/env bash
# Export the package as it was before the redesign (commit 51ed29a) into .device/before/ of the
# checkout this script lives in, for benchmarks/before_after.sh to run its own op_overhead.py on
# the GPU machine (which has no git). .device/ is git-ignored and carried to that machine.
#
#   benchmarks/make_before.sh [COMMIT]        (default 51ed29a; run where the repository's git is)
#
# Only what the old benchmark imports is exported (compileattn/, passes/, benchmarks/op_overhead.py and its helpers:
# ~0.4 MB), so the carried .device/ stays within its size limit beside the FlashAttention-4 pack.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
commit="${1:-51ed29a}"
dest="$root/.device/before"
full="$(git -C "$root" rev-parse --verify "$commit^{commit}")"
rm -rf "$dest"
mkdir -p "$dest"
# op_overhead.py's own helpers, where that tree has them (later trees import common.py)
paths=(compileattn passes benchmarks/op_overhead.py)
for helper in benchmarks/common.py benchmarks/op_overhead_report.py; do
    if git -C "$root" cat-file -e "$full:$helper" 2>/dev/null; then paths+=("$helper"); fi
done
git -C "$root" archive "$full" "${paths[@]}" | tar -x -C "$dest"
echo "$full" > "$dest/COMMIT"
echo "exported $(git -C "$root" log -1 --format='%h %s' "$full") into $dest ($(du -sh "$dest" | cut -f1))"
