#!/usr/bin/env python
"""Quick H200 check of the triton backend's paged decode kernel, with a tuning sweep.

Shape (issue 4): GQA 64 query / 8 KV heads, head dim 128, bf16, page 16, every sequence
``--context`` tokens (default 4096), batches 1/16/64/256. Bar: FlashInfer 0.7.4 tensor-core
decode on the same H200: 12 / 74 / 252 / 983 µs.

Per batch it times, as GPU µs per call (``common.gpu_time_us``: calls captured in a CUDA graph,
replays timed with events; calls cycle over disjoint page sets totalling >= 4x L2, so K/V come
from HBM):

- ``default``: the decode launch the backend binds (heuristic tiles and split count);
- ``sweep``: tiles (keys per tile, warps, pipeline stages, tail mode ``t``: 0 = last tile folded
  into the body loop, n = own n-stage loop) and split counts around the heuristic;
  the best is printed with its config, so ``config.py`` defaults can be updated from one run;
- ``unified``: the same decode batch through the unified varlen kernel (what a mixed batch's
  decode rows cost), to judge whether mixed batches should be split;
- ``forward``: ``backend.forward`` (one-token KV write + attention) with the default plan.

Then the unified kernel alone on a prefill (4 x 1024 new tokens) and a chunked prefill (2 x 512
new after 3584 cached), default tiles and a few neighbours, as µs and causal TFLOP/s.

Host cost: CPU µs per ``backend.forward`` call (write, decode, and at batch 1, with more than 4
splits, the combine) against an empty ``torch.add`` launch, measured back-to-back at batch 1 where
the GPU is idle.

Each configuration's output is checked against an fp32 attention over the same pages before its
time is kept (``FAIL`` otherwise). Prints markdown; ``--json PATH`` also writes every number.
Run from the repo root: ``python benchmarks/triton_decode_quick.py`` (``--no-sweep`` for defaults
only). Needs CUDA; exits 0 with a message otherwise.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402

H, KVH, D = 64, 8, 128
DEV = "cuda"
DTYPE_NAME = "bfloat16"
FLASHINFER_US = {1: 12.0, 16: 74.0, 64: 252.0, 256: 983.0}  # issue 4, H200, context 4096, page 16
TOLERANCE = 2e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batches", type=common.parse_int_list, default=[1, 16, 64, 256])
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


class Step:
    """One decode batch: q, a cache holding ``rotations`` disjoint page sets, one table per set."""

    def __init__(self, torch, batch, context, page, l2_bytes):
        dev = DEV
        self.batch, self.context = batch, context
        per_seq = math.ceil(context / page)
        kv_bytes = 2 * batch * context * KVH * D * 2
        self.kv_bytes = kv_bytes
        self.rotations = common.rotations_for(kv_bytes, l2_bytes, max_copies=16)
        nb = self.rotations * batch * per_seq
        g = torch.Generator(device=dev).manual_seed(batch)
        dtype = getattr(torch, DTYPE_NAME)
        self.kc = torch.randn(nb, page, KVH, D, device=dev, generator=g).to(dtype)
        self.vc = torch.randn(nb, page, KVH, D, device=dev, generator=g).to(dtype)
        self.q = torch.randn(batch, H, D, device=dev, generator=g).to(dtype)
        perm = torch.randperm(nb, device=dev, generator=g).to(torch.int32)
        self.tables = [perm[r * batch * per_seq:(r + 1) * batch * per_seq].view(batch, per_seq).contiguous()
                       for r in range(self.rotations)]
        self.cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        self.seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        self.out = torch.empty_like(self.q)
        self.page = page
        self.want = self.reference(torch, n=min(batch, 2))

    def reference(self, torch, n):
        from compileattn.backends.reference import attend_one_sequence, gather_paged

        outs = []
        for i in range(n):
            k = gather_paged(self.kc, self.tables[0][i], self.context)
            v = gather_paged(self.vc, self.tables[0][i], self.context)
            outs.append(attend_one_sequence(self.q[i:i + 1], k, v, D ** -0.5, True, -1, 0.0))
        return torch.cat(outs)

    def check(self, torch) -> float:
        n = self.want.shape[0]
        return common.rel_error(self.out[:n].float(), self.want)


def time_launch(torch, step, launch_fn):
    """(µs, TB/s, error) of ``launch_fn(table)``; error checked on rotation 0 before timing."""
    step.out.fill_(float("nan"))
    launch_fn(step.tables[0])
    torch.cuda.synchronize()
    err = step.check(torch)
    if not err <= TOLERANCE:
        return None, None, err
    t = common.gpu_time_us(lambda r: launch_fn(step.tables[r]), rotations=step.rotations, target_ms=3.0, reps=5)
    return t.us, step.kv_bytes / (t.us * 1e-6) / 1e12, err


def decode_launcher(torch, step, cfg, splits):
    from compileattn.backends.triton.launch import DecodeLaunch, FreshScratch, Softmax

    launch = DecodeLaunch(cfg, step.batch, H, KVH, D, step.page, step.q.dtype, Softmax(D ** -0.5, 0.0, -1),
                          splits, FreshScratch(DEV))
    return lambda table: launch(step.q, step.kc, step.vc, step.out, step.cu_q, step.seq_lens, table)


def unified_launcher(torch, step):
    from compileattn.backends.triton.config import unified_config
    from compileattn.backends.triton.launch import Softmax, UnifiedLaunch

    cfg = unified_config(H // KVH, D, step.q.dtype)
    launch = UnifiedLaunch(cfg, step.batch, step.batch, H, KVH, D, step.page, step.q.dtype,
                           Softmax(D ** -0.5, 0.0, -1), True, paged=True, has_seq_lens=True)
    return lambda table: launch(step.q, step.kc, step.vc, step.out, step.cu_q, None, step.seq_lens, table)


def forward_case(torch, step):
    """``forward()``: one layer of one step (the prepared KV write, then attention) on rotation 0,
    through the unified op under real metadata (context - 1 cached tokens + this one)."""
    from compileattn import AttentionMetadataBuilder, AttentionSpec, KVCache, SequenceStep, set_forward_context

    spec = AttentionSpec(H, KVH, D)
    table = step.tables[0]
    b = AttentionMetadataBuilder(block_size=step.page, num_blocks=step.kc.shape[0], max_num_tokens=step.batch,
                                 max_blocks_per_seq=table.shape[1], device=DEV, backend="triton")
    md = b.build([SequenceStep(1, step.context - 1, row) for row in table.tolist()])
    caches = {"layer": KVCache(step.kc, step.vc, spec)}
    k = torch.randn(step.batch, KVH, D, device=DEV, dtype=step.q.dtype)
    v = torch.randn_like(k)
    with set_forward_context(md, caches) as ctx:
        write, attend = ctx.write["layer"], ctx.attend["layer"]

    def forward():
        write(k, v)
        attend(step.q, step.out)

    return forward


class Prefill:
    """Prefill / chunked prefill: ``seqs`` of (new tokens, cached tokens), all K/V already paged."""

    def __init__(self, torch, seqs, page):
        dev, dtype = DEV, getattr(torch, DTYPE_NAME)
        self.seqs = seqs
        need = [math.ceil((q + c) / page) for q, c in seqs]
        nb = sum(need)
        g = torch.Generator(device=dev).manual_seed(7)
        self.kc = torch.randn(nb, page, KVH, D, device=dev, generator=g).to(dtype)
        self.vc = torch.randn(nb, page, KVH, D, device=dev, generator=g).to(dtype)
        t = sum(q for q, _ in seqs)
        self.q = torch.randn(t, H, D, device=dev, generator=g).to(dtype)
        self.out = torch.empty_like(self.q)
        perm = torch.randperm(nb, device=dev, generator=g).to(torch.int32)
        self.table = torch.zeros(len(seqs), max(need), dtype=torch.int32, device=dev)
        i = 0
        for s, n in enumerate(need):
            self.table[s, :n] = perm[i:i + n]
            i += n
        self.cu_q = torch.tensor([0] + [sum(q for q, _ in seqs[:i + 1]) for i in range(len(seqs))],
                                 dtype=torch.int32, device=dev)
        self.seq_lens = torch.tensor([q + c for q, c in seqs], dtype=torch.int32, device=dev)
        self.page = page
        # causal: query i of q_len after c cached tokens sees c + i + 1 keys; 2 dots x 2 flop per MAC
        self.flops = sum(4 * H * D * (q * c + q * (q + 1) // 2) for q, c in seqs)

    def check(self, torch) -> float:
        from compileattn.backends.reference import attend_one_sequence, gather_paged

        q0, c0 = self.seqs[0]
        k = gather_paged(self.kc, self.table[0], q0 + c0)
        v = gather_paged(self.vc, self.table[0], q0 + c0)
        want = attend_one_sequence(self.q[:q0], k, v, D ** -0.5, True, -1, 0.0)
        return common.rel_error(self.out[:q0].float(), want)


def time_prefill(torch, case, cfg):
    from compileattn.backends.triton.launch import Softmax, UnifiedLaunch

    launch = UnifiedLaunch(cfg, case.q.shape[0], len(case.seqs), H, KVH, D, case.page, case.q.dtype,
                           Softmax(D ** -0.5, 0.0, -1), True, paged=True, has_seq_lens=True)

    def fn(_r=0):
        launch(case.q, case.kc, case.vc, case.out, case.cu_q, None, case.seq_lens, case.table)

    case.out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    err = case.check(torch)
    if not err <= TOLERANCE:
        return None, err
    return common.gpu_time_us(fn, target_ms=5.0, reps=5).us, err


def host_us(torch, fn, n=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    msg = common.cuda_missing_message("triton_decode_quick.py")
    if msg:
        print(msg)
        return 0
    import torch

    from compileattn.backends.triton.config import DecodeConfig, decode_config, fills_waves, num_splits, sm_count

    log = common.Log()
    budget = common.Budget(args.budget_s)
    sms = sm_count(DEV, torch.cuda.current_device() if DEV == "cuda" else None)
    l2 = common.l2_cache_bytes()
    bw = common.copy_bandwidth()
    log(f"{torch.cuda.get_device_name()}  SMs={sms}  L2={l2 >> 20} MiB  copy={bw['GBps'] / 1e3:.2f} TB/s")
    results = {"device": torch.cuda.get_device_name(), "copy_TBps": bw["GBps"] / 1e3, "rows": []}
    summary = []
    for batch in args.batches:
        step = Step(torch, batch, args.context, args.page, l2)
        default_splits = num_splits(batch, KVH, sms)
        base = decode_config(H // KVH, D, getattr(torch, DTYPE_NAME), args.page, full_waves=fills_waves(batch, KVH, sms))
        row = {"batch": batch, "default": None, "sweep": [], "rotations": step.rotations}
        us, tbps, err = time_launch(torch, step, decode_launcher(torch, step, base, default_splits))
        row["default"] = dict(cfg=base.__dict__, splits=default_splits, us=us, TBps=tbps, err=err)
        log(f"batch {batch}: default {base} splits={default_splits}: "
            + (f"{us:.1f} us {tbps:.2f} TB/s" if us else f"FAIL err={err:.3g}"))
        best = (us, f"default (N{base.block_n} w{base.num_warps} s{base.num_stages} t{base.tail_stages} "
                    f"splits {default_splits})")
        if not args.no_sweep:
            split_set = sorted({1, max(1, default_splits // 2), default_splits, default_splits * 2}
                               | ({8, 16, 32, 64} if batch <= 4 else set()) | ({2, 3, 4, 6} if batch <= 32 else set()))
            def tail(n, s):  # the heuristic's tail mode for that tile (config.decode_config)
                return s if args.page > 1 and args.page % n else 0

            tiles = [DecodeConfig(base.block_m, n, w, s, tail(n, s))
                     for n, w, s in itertools.product((16, 32, 64, 128), (4, 8), (2, 3))]
            tiles += [DecodeConfig(base.block_m, base.block_n, base.num_warps, base.num_stages, t)
                      for t in (0, 1, base.num_stages)]
            grid = [(base, s) for s in split_set if s != default_splits]
            grid += [(c, default_splits) for c in tiles if c != base]
            for cfg, splits in grid:
                if budget.left() < 30:
                    log("budget nearly spent: sweep cut short")
                    break
                try:
                    us2, tb2, err2 = time_launch(torch, step, decode_launcher(torch, step, cfg, splits))
                except Exception as exc:  # noqa: BLE001  (a config that does not compile/run is data)
                    us2, tb2, err2 = None, None, common.short_error(exc, 120)
                row["sweep"].append(dict(cfg=cfg.__dict__, splits=splits, us=us2, TBps=tb2, err=err2))
                tag = f"N{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} t{cfg.tail_stages} splits {splits}"
                log(f"  {tag}: " + (f"{us2:.1f} us {tb2:.2f} TB/s" if us2 else f"FAIL {err2}"))
                if us2 and (best[0] is None or us2 < best[0]):
                    best = (us2, tag)
        try:
            u_us, u_tb, u_err = time_launch(torch, step, unified_launcher(torch, step))
        except Exception as exc:  # noqa: BLE001
            u_us, u_tb, u_err = None, None, common.short_error(exc, 120)
        row["unified"] = dict(us=u_us, TBps=u_tb, err=u_err)
        forward = forward_case(torch, step)
        fwd = common.gpu_time_us(lambda r: forward(), target_ms=3.0, reps=5)
        row["forward_us"] = fwd.us
        summary.append((batch, FLASHINFER_US.get(batch), us, tbps, best, u_us, fwd.us))
        results["rows"].append(row)
        del step, forward
        torch.cuda.empty_cache()

    # Unified kernel on prefill shapes: default tiles and a few neighbours.
    from compileattn.backends.triton.config import UnifiedConfig, unified_config

    prefill_rows = []
    if not args.no_prefill:
        ubase = unified_config(H // KVH, D, getattr(torch, DTYPE_NAME))
        variants = [ubase] + [UnifiedConfig(m, m // (H // KVH), n, w, st) for m, n, w, st in
                              ((128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3))]
        for name, seqs in (("prefill 4 x 1024", [(1024, 0)] * 4),
                           ("chunked prefill 2 x 512 after 3584", [(512, 3584)] * 2)):
            case = Prefill(torch, seqs, args.page)
            for cfg in variants:
                if budget.left() < 20:
                    break
                try:
                    us_p, err_p = time_prefill(torch, case, cfg)
                except Exception as exc:  # noqa: BLE001
                    us_p, err_p = None, common.short_error(exc, 120)
                tag = f"M{cfg.block_m} N{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                tflops = case.flops / (us_p * 1e-6) / 1e12 if us_p else None
                log(f"{name} {tag}: " + (f"{us_p:.1f} us {tflops:.0f} TFLOP/s" if us_p else f"FAIL {err_p}"))
                prefill_rows.append([name, tag + (" (default)" if cfg == ubase else ""), common.fmt_num(us_p),
                                     common.fmt_num(tflops, 0)])
            del case
    results["prefill"] = prefill_rows

    # Host cost per forward call (batch 1: GPU time is far below launch cost, so the loop is CPU-bound).
    step = Step(torch, 1, args.context, args.page, l2)
    forward = forward_case(torch, step)
    x = torch.zeros(1, device=DEV)
    host_fwd = host_us(torch, forward)
    host_add = host_us(torch, lambda: torch.add(x, 1, out=x))
    results["host_us"] = {"forward": host_fwd, "empty_add": host_add}

    fmt = common.fmt_num
    rows = []
    for batch, fi, us, tbps, best, u_us, f_us in summary:
        ratio = f"{us / fi:.2f}" if us and fi else "n/a"
        rows.append([batch, fmt(fi), fmt(us), fmt(tbps, 2), ratio, f"{fmt(best[0])} ({best[1]})", fmt(u_us), fmt(f_us)])
    print()
    print(f"Paged decode, GQA {H}/{KVH}, head dim {D}, {DTYPE_NAME}, page {args.page}, context {args.context} "
          f"({results['device']}, copy {results['copy_TBps']:.2f} TB/s)")
    print(common.markdown_table(
        ["batch", "FlashInfer µs (issue)", "triton µs", "TB/s", "÷FI", "best swept µs (config)", "unified µs",
         "forward µs"], rows))
    print(f"\nhost µs per backend.forward call (batch 1): {host_fwd:.1f}; empty torch.add launch: {host_add:.1f}")
    if prefill_rows:
        print("\nUnified kernel (paged, page %d, causal):" % args.page)
        print(common.markdown_table(["case", "tiles", "µs", "TFLOP/s"], prefill_rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
