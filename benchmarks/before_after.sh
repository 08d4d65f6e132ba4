#!/usr/bin/env bash
# op_overhead before and after the package redesign, in one GPU session, merged into one table:
#
#   1. before: the tree exported by benchmarks/make_before.sh into .device/before (commit 51ed29a),
#      its own benchmarks/op_overhead.py, that tree first on PYTHONPATH (the script also puts its
#      own root first on sys.path);
#   2. after: this tree's benchmarks/op_overhead.py;
#   3. merge: op_overhead.py --merge BEFORE AFTER, the after ÷ before table (op_overhead_report.py).
#
#   benchmarks/before_after.sh OUT_DIR     (FlashAttention-4 on PYTHONPATH first:
#                                           source .device/flash-attn-4.sh)
#
# Writes OUT/op_overhead_before.json (the old script's layout) or, when its run was cut by its time
# limit before writing it, OUT/op_overhead_before.log (its stdout: the merge reads its row lines),
# OUT/op_overhead_after.json and OUT/op_overhead.{json,md}. Both runs get the same batches and
# repetitions. Environment: OP_BATCHES (default 1,16,64), OP_REPS (11), OP_LIMIT_S (per run, 100).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:?usage: benchmarks/before_after.sh OUT_DIR}"
mkdir -p "$out"
before=.device/before
batches="${OP_BATCHES:-1,16,64}"
reps="${OP_REPS:-11}"
limit="${OP_LIMIT_S:-100}"
work="$(mktemp -d)"
export PYTHONUNBUFFERED=1   # a run cut by its limit still leaves every row it printed
t0="${HOUSE_T0:-$(date +%s)}"   # seconds are counted from the first script of the run
export HOUSE_T0="$t0"
say() { echo "[$(printf '%4d' $(( $(date +%s) - t0 )))s] $*"; }

if [ ! -f "$before/benchmarks/op_overhead.py" ]; then
    say "no $before/benchmarks/op_overhead.py: run benchmarks/make_before.sh where git is, and carry .device"
    exit 2
fi
commit="$(cut -c1-7 "$before/COMMIT")"

say "before: $commit's own op_overhead.py (limit ${limit} s)"
PYTHONPATH="$PWD/$before${PYTHONPATH:+:$PYTHONPATH}" timeout -k 5 "$limit" \
    python "$before/benchmarks/op_overhead.py" --batches "$batches" --reps "$reps" --out "$work/before" \
    2>&1 | tee "$work/before.log"
say "before: exit ${PIPESTATUS[0]}"
if [ -f "$work/before.json" ]; then
    before_result="$out/op_overhead_before.json"
    cp "$work/before.json" "$before_result"
else
    before_result="$out/op_overhead_before.log"
    cp "$work/before.log" "$before_result"
    say "before: no JSON (cut short?): the merge reads the rows it printed"
fi

say "after: this tree's op_overhead.py (limit ${limit} s)"
timeout -k 5 "$limit" python benchmarks/op_overhead.py --batches "$batches" --reps "$reps" \
    --budget-s $((limit - 25)) --label "after: this tree" --no-plot --out "$work/after" 2>&1 | tee "$work/after.log"
say "after: exit ${PIPESTATUS[0]}"
[ -f "$work/after.json" ] && cp "$work/after.json" "$out/op_overhead_after.json"

say "merge"
python benchmarks/op_overhead.py --merge "$before_result" "$out/op_overhead_after.json" \
    --labels "before: $commit (pre-redesign tree, its own op_overhead.py)" "after: this tree" \
    -o "$out/op_overhead" --no-plot > "$work/merge.log" 2>&1
rc=$?
sed -n '/^## After ÷ before/,/^Which variant/p' "$out/op_overhead.md" 2>/dev/null || tail -20 "$work/merge.log"
say "merge: exit $rc"
exit "$rc"
