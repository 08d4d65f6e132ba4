#!/usr/bin/env bash
# The GPU run behind issue 10's benchmark side and issue 12's roofline column, one command of at
# most ~5 minutes on one H200:
#
#   0. FlashAttention-4 from the carried pack (source .device/flash-attn-4.sh; unpacks once).
#   1. op_overhead before/after (benchmarks/before_after.sh): the pre-redesign tree's own script
#      (.device/before, made by benchmarks/make_before.sh) and this one, flash and triton, merged
#      into one table with after ÷ before. Both runs: OP_REPS repetitions (default 7 here, 11 in the
#      scripts: the time goes to the latency part), each run limited to OP_LIMIT_S (default 90 s).
#   2. latency.py --quick --backend flash (OPT shape, batch 1 and 8 at context 512 and the mixed
#      step; every column: eager, the torch.compile ones, compileattn piecewise and full-decode, the
#      hand-captured full graphs) with the roofline, against the committed
#      benchmarks/results/latency_opt.json (--baseline: p50 ÷ baseline per row), --budget-s = the
#      time left.
#
#   bash benchmarks/gpu_house.sh OUT_DIR        (carry .device: the FA4 pack and .device/before)
#   GPU_HOUSE_TOTAL_S=295 by default: the whole script; the latency part gets what is left.
#
# Files (flat, 7): OUT/house.log (everything printed, the seconds of each part),
# OUT/op_overhead_before.json (or .log if that run was cut short), OUT/op_overhead_after.json,
# OUT/op_overhead.{json,md}, OUT/latency_quick.{json,md}. Plots: re-draw them on any machine
# with --merge (the GPU machine may lack matplotlib, and the file count is limited).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:?usage: benchmarks/gpu_house.sh OUT_DIR}"
mkdir -p "$out"
total="${GPU_HOUSE_TOTAL_S:-295}"
log="$out/house.log"
export PYTHONUNBUFFERED=1
t0="${HOUSE_T0:-$(date +%s)}"   # seconds are counted from the first script of the run
export HOUSE_T0="$t0"
say() { echo "[$(printf '%4d' $(( $(date +%s) - t0 )))s] $*" | tee -a "$log"; }

say "$(python -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")' 2>&1)"

t=$SECONDS
# shellcheck source=/dev/null
source .device/flash-attn-4.sh || say "the FlashAttention-4 pack did not unpack: the flash rows will say why"
say "part 0 (FA4 pack): $((SECONDS - t)) s"

t=$SECONDS
OP_REPS="${OP_REPS:-7}" OP_LIMIT_S="${OP_LIMIT_S:-90}" bash benchmarks/before_after.sh "$out" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
say "part 1 (op_overhead before/after): $((SECONDS - t)) s, exit $rc"

left=$(( total - SECONDS ))
budget=$(( left - 35 ))   # the group in flight when the budget ends, writing results, teardown
if [ "$budget" -lt 60 ]; then
    say "part 2 (latency --quick) skipped: only $left s left"
else
    t=$SECONDS
    say "part 2 (latency --quick, --budget-s $budget, limit $(( left - 5 )) s)"
    timeout -k 10 $(( left - 5 )) python benchmarks/latency.py --quick --backend flash --budget-s "$budget" \
        --no-plot --label "quick / flash, this tree" --baseline benchmarks/results/latency_opt.json \
        --out "$out/latency_quick" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    say "part 2 (latency --quick): $((SECONDS - t)) s, exit $rc"
fi
say "total: $SECONDS s; files: $(ls "$out" | tr '\n' ' ')"
