#!/usr/bin/env bash
# Issue 12's measurements on one H200, in two device calls of under ~9.5 minutes each (a call is
# limited to 10; the two optional packs do not fit in one transfer, and only part b needs one):
#
#   a: latency.py on the OPT shape (every column; its cold/warm subprocesses after them),
#      coldwarm.py (both models, fresh processes), op_overhead.py (the Triton op's host cost),
#      host_step.py (a full-decode step's host time above a bare replay). No pack.
#   b: decode_attention.py page 16 against FlashInfer (source .devfi/flashinfer.sh first: made
#      by ../shared/device/pack-flashinfer .devfi, carried as .devfi), then latency.py on the
#      Llama-3-8B shape.
#
#   BENCH_COMMIT=<full sha> bash benchmarks/issue12_gpu.sh a "$OUT" S28-1
#   source .devfi/flashinfer.sh && BENCH_COMMIT=<sha> bash benchmarks/issue12_gpu.sh b "$OUT" S28-2
#
# Each script writes OUT/<name>_<TAG>.{json,md} and its log OUT/<name>_<TAG>.log; OUT/rc.txt has
# every exit status. Every script has its own timeout, so a slow one cannot take the others' time,
# and what finished is on disk when the call's limit ends it. BENCH_COMMIT is required: the
# device's checkout has no usable .git, and a result without its commit cannot be compared.
# Afterwards, on any machine: python benchmarks/goals.py --latency ... (see benchmarks/README.md).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part="${1:?usage: issue12_gpu.sh a|b OUT_DIR TAG}"
out="${2:?usage: issue12_gpu.sh a|b OUT_DIR TAG}"
tag="${3:?usage: issue12_gpu.sh a|b OUT_DIR TAG}"
: "${BENCH_COMMIT:?set BENCH_COMMIT to the full commit sha of this tree}"
export BENCH_COMMIT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
short="${BENCH_COMMIT:0:7}"

step() {  # step NAME LIMIT_S python-args...
    local name="$1" limit="$2"
    shift 2
    local t=$SECONDS
    timeout -k 10 "$limit" python "$@" > "$out/${name}_${tag}.log" 2>&1
    local rc=$?
    echo "$name rc $rc ($((SECONDS - t)) s)" | tee -a "$out/rc.txt"
}

nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$out/gpu_${tag}.txt" 2>&1
case "$part" in
    a)
        step latency_opt 240 benchmarks/latency.py --models opt --backend triton --budget-s 190 --no-plot \
            --label "opt / triton, $tag ($short)" --out "$out/latency_opt_$tag"
        step coldwarm 160 benchmarks/coldwarm.py --budget-s 130 --triton-cache-dir unset --out "$out/coldwarm_$tag"
        step op_overhead 70 benchmarks/op_overhead.py --backends triton --batches 1,16,64 --reps 7 --budget-s 50 \
            --no-plot --label "$tag ($short)" --out "$out/op_overhead_$tag"
        # host_step has no --budget-s (compiles two OPT models, then 2 x 7 rounds; README: ~1-2 min); it
        # writes its files after each batch. 240 + 160 + 70 + 100 s = 570 s at worst.
        step host_step 100 benchmarks/host_step.py --batches 1,8 -o "$out/host_step_$tag"
        ;;
    b)
        step decode_page16 190 benchmarks/decode_attention.py --impls ca-triton,fi-tc --pages 16 \
            --shapes gqa64x8,mha32 --budget-s 140 --no-plot --label "$tag ($short)" --out "$out/decode_page16_$tag"
        step latency_llama 360 benchmarks/latency.py --models llama --backend triton \
            --columns eager,graph-eager,ca-piecewise,ca-full,reduce-overhead,graph-inductor --no-mixed \
            --budget-s 310 --no-plot --label "llama / triton, $tag ($short)" --out "$out/latency_llama_$tag"
        ;;
    *)
        echo "part must be a or b, got $part" >&2
        exit 2
        ;;
esac
grep -h "MET" "$out"/*_"$tag".md 2>/dev/null | sort -u
