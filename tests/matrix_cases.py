"""Attention problems for the kernel matrix (test_kernel_matrix.py), and how their answers are judged.

Nothing here knows a backend: this module draws cases, makes their tensors, computes the
reference answers and applies FlashAttention's tolerance rule; the test module's adapter runs them.

Cases. A ``Config`` holds what a kernel is specialised (compiled) for: dtype, head dim, head
layout, causal, window or not, softcap, contiguous or paged K/V and the page size, ALiBi or not
(the standard slopes of ``compileattn.alibi_slopes``), and (asked of support checks only, not drawn
into cases) an fp8 KV cache. A ``Case`` adds
what varies per call: the (query length, key length) of each sequence, the window size, the
softmax scale, the entry point, rows past the last sequence. FA4 JIT-compiles every kernel
configuration for seconds and Triton compiles one per constexpr set, so the sample draws few
configurations, chosen so that every pair of values of any two config axes occurs in one
(``covering_configs``: a seeded greedy all-pairs design), and many shapes per configuration.

Tensors. Paged K/V: pages handed out in a shuffled order, every page slot past a sequence's
length and every unused block-table entry filled with large finite garbage (unused entries point
at garbage pages), so reading a wrong slot gives a wrong answer instead of passing by luck.
Contiguous K/V with ``seqused_k``: garbage rows after each sequence's used keys.

Judging (FlashAttention's tests, ``attention_ref`` with ``upcast`` on and off): per sequence, the
kernel's max-abs error to a float64 reference must be at most 2x (3x with softcap: FlashAttention
uses ``rtol = 3`` there) the error of the same reference computed in the kernel's dtype, plus a
tiny absolute slack; outputs must be non-finite exactly where the reference is; a query that sees
no key must output exact zeros, and so must rows past the last sequence.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import NamedTuple, Sequence

import torch

from compileattn import alibi_slopes

#: Absolute slack of the tolerance rule. Needed only where the low-precision reference is exact
#: (a query that sees one key outputs that key's value, bit for bit) or, in float32, about as
#: accurate as the kernel: the kernel may then differ by fp32-level rounding (exp2 for exp, a
#: reciprocal, summation order), about 1e-7 x |out| per operation with |out| <= ~5. 1e-5 covers
#: that and is ~100x below one fp16 ulp at 1.0 (~800x below bf16's); a masking or indexing error
#: moves outputs by far more. (FlashAttention adds about one output ulp instead.)
ABS_SLACK = 1e-5
#: Magnitude of the garbage in unused cache slots and pages: a key read by mistake dominates the
#: softmax and a value read by mistake dominates the output.
GARBAGE = 30.0
LAYOUTS = ("contiguous", "contiguous+seqused")  # besides page sizes (ints)


class Config(NamedTuple):
    """What a kernel is compiled for."""

    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    causal: bool
    windowed: bool
    softcap: float
    layout: str | int  # "contiguous", "contiguous+seqused" or the page size of paged K/V
    alibi: bool = False
    kv_fp8: bool = False  # K/V stored as float8_e4m3fn (support checks only)

    @property
    def paged(self) -> bool:
        return isinstance(self.layout, int)

    @property
    def page_size(self) -> int | None:
        return self.layout if self.paged else None

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "").replace("float", "fp").replace("bfp", "bf")
        kv = f"page{self.layout}" if self.paged else ("contig+used" if self.layout != "contiguous" else "contig")
        return (f"{dt}-d{self.head_dim}-h{self.num_heads}x{self.num_kv_heads}-{'causal' if self.causal else 'full'}"
                f"{'-win' if self.windowed else ''}{'-cap' if self.softcap else ''}{'-alibi' if self.alibi else ''}"
                f"{'-fp8kv' if self.kv_fp8 else ''}-{kv}")

    @property
    def alibi_slopes(self) -> tuple[float, ...] | None:
        return alibi_slopes(self.num_heads) if self.alibi else None


class Case(NamedTuple):
    index: int
    config: Config
    seqlens: tuple[tuple[int, int], ...]  # (query length, key length) per sequence
    window_left: int  # -1: no window
    scale: float | None  # None: 1/sqrt(head_dim)
    entry: str  # "varlen": flash_attn_varlen_func; "layer": the per-layer op over a paged cache
    extra_rows: int  # layer entry: padding tokens (zero rows); varlen: 0
    causal_as_window: bool  # varlen: pass causal as window_size=(left, 0)
    seed: int

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.config.head_dim)

    @property
    def case_id(self) -> str:
        return f"{self.index:03d}-{self.config.describe()}-{self.entry}"

    def describe(self) -> str:
        c = self.config
        return (f"case {self.index}: {c.dtype}, head_dim {c.head_dim}, heads {c.num_heads}/{c.num_kv_heads}, "
                f"causal={c.causal}{' (as window_size=(left, 0))' if self.causal_as_window else ''}, "
                f"window_left={self.window_left}, softcap={c.softcap}, alibi={c.alibi}, K/V {c.layout}"
                f"{' (page size)' if c.paged else ''}, entry {self.entry}, (q_len, k_len)={list(self.seqlens)}, "
                f"scale={self.softmax_scale:.4g}, extra rows {self.extra_rows}, seed {self.seed}")


# ---------------------------------------------------------------------------------------------
# sampling


def covering_configs(axes: dict[str, Sequence], rng: random.Random, candidates: int = 40) -> list[Config]:
    """Configs in which every pair of values of any two axes occurs (greedy all-pairs).

    ``axes`` maps each ``Config`` field to its values, except ``heads``: (num_heads, num_kv_heads)
    pairs. Each step takes one still-uncovered pair of values, tries ``candidates`` random
    completions and keeps the one covering the most uncovered pairs. Deterministic for a seeded
    ``rng`` (pairs are sorted before choosing: set order differs between processes, e.g. xdist
    workers, which must collect the same tests).
    """
    names = list(axes)
    sizes = [len(axes[n]) for n in names]

    def pairs(row):
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(range(len(names)), 2)}

    uncovered = set().union(*(pairs(row) for row in itertools.product(*(range(s) for s in sizes))))
    rows = []
    while uncovered:
        a, x, b, y = rng.choice(sorted(uncovered))
        best, gain = None, -1
        for _ in range(candidates):
            row = [rng.randrange(s) for s in sizes]
            row[a], row[b] = x, y
            g = len(pairs(row) & uncovered)
            if g > gain:
                best, gain = row, g
        rows.append(best)
        uncovered -= pairs(best)
    configs = []
    for row in rows:
        values = {n: axes[n][i] for n, i in zip(names, row)}
        values["num_heads"], values["num_kv_heads"] = values.pop("heads")
        configs.append(Config(**values))
    return configs


class ShapePool(NamedTuple):
    """Sequence shapes to draw from (FlashAttention's test lengths, scaled to the device)."""

    equal: tuple[int, ...]  # q == k (prefill)
    shorter: tuple[tuple[int, int], ...]  # q < k (chunked prefill over a cached prefix)
    longer: tuple[tuple[int, int], ...]  # q > k (bottom-right causal: the first rows see nothing)
    decode_k: tuple[int, ...]  # key lengths of 1-token queries
    empty: tuple[tuple[int, int], ...]  # no keys, or no queries
    max_seqs: int
    max_tokens: int


GPU_SHAPES = ShapePool(
    equal=(1, 2, 3, 17, 64, 113, 128, 255, 256, 509, 1023, 1024, 2048),
    shorter=((1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217), (113, 211), (108, 256),
             (256, 512), (1023, 1024), (7, 2048), (61, 1999)),
    longer=((512, 256), (113, 61), (97, 1), (5, 2), (1024, 1023), (200, 3)),
    decode_k=(1, 2, 16, 17, 63, 97, 256, 257, 1000, 2047),
    empty=((1, 0), (9, 0), (0, 37)),
    max_seqs=8, max_tokens=4096,
)
CPU_SHAPES = ShapePool(
    equal=(1, 2, 3, 16, 17, 31),
    shorter=((1, 37), (3, 61), (13, 50), (7, 64), (16, 33)),
    longer=((17, 5), (5, 2), (9, 1)),
    decode_k=(1, 2, 16, 17, 63, 97),
    empty=((1, 0), (0, 13)),
    max_seqs=4, max_tokens=48,
)
#: Windows drawn for windowed configs (0: a query sees only its own key).
WINDOWS = (0, 5, 37, 200, 1000)


def draw_seqlens(rng: random.Random, pool: ShapePool, layer: bool) -> tuple[tuple[int, int], ...]:
    kind = rng.choices(("decode", "prefill", "chunked", "mixed"), weights=(25, 20, 20, 35))[0]
    if kind == "decode":
        lens = [(1, rng.choice(pool.decode_k)) for _ in range(rng.randint(1, pool.max_seqs))]
    elif kind == "prefill":
        lens = [(n, n) for n in rng.choices(pool.equal, k=rng.randint(1, 3))]
    elif kind == "chunked":
        lens = rng.choices(pool.shorter, k=rng.randint(1, 3))
    else:
        every = ([(1, k) for k in pool.decode_k] + [(n, n) for n in pool.equal] + list(pool.shorter)
                 + list(pool.longer))
        lens = rng.choices(every, k=rng.randint(2, 4))
        if rng.random() < 0.3:
            lens.insert(rng.randrange(len(lens) + 1), rng.choice(pool.empty))
    if layer:  # the per-layer op serves steps: every sequence has a query and its keys include it
        lens = [(q, k) for q, k in lens if 1 <= q <= k] or [(1, rng.choice(pool.decode_k))]
    while len(lens) > 1 and sum(q for q, _ in lens) > pool.max_tokens:
        lens.pop(rng.randrange(len(lens)))
    return tuple(lens)


def sample_cases(configs: Sequence[Config], per_config: int, pool: ShapePool, seed: int,
                 layer_share: float = 1 / 3) -> list[Case]:
    """``per_config`` cases for each config, in config order (each kernel compiles once in a run)."""
    rng = random.Random(seed)
    cases = []
    for config in configs:
        for _ in range(per_config):
            layer = config.paged and rng.random() < layer_share
            window = rng.choice(WINDOWS) if config.windowed else -1
            cases.append(Case(
                index=len(cases), config=config, seqlens=draw_seqlens(rng, pool, layer), window_left=window,
                scale=None if rng.random() < 0.75 else 0.2, entry="layer" if layer else "varlen",
                # varlen: every row belongs to a sequence (the entry refuses others); layer: padding
                extra_rows=rng.choice((0, 0, 3)) if layer else 0,
                causal_as_window=config.causal and not layer and rng.random() < 0.25,
                seed=seed * 100_003 + len(cases)))
    return cases


# ---------------------------------------------------------------------------------------------
# tensors


@dataclasses.dataclass
class SeqData:
    """Per-sequence inputs: qs[i] (q_len, H, D), ks[i]/vs[i] (k_len, KVH, D), and the q rows past
    the last sequence (varlen) or of the padding tokens (layer)."""

    qs: list[torch.Tensor]
    ks: list[torch.Tensor]
    vs: list[torch.Tensor]
    q_tail: torch.Tensor


@dataclasses.dataclass
class Packed:
    """A case's tensors in the form its entry point takes."""

    q: torch.Tensor
    k: torch.Tensor  # contiguous (total_k, KVH, D) or a paged cache (num_blocks, page, KVH, D)
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor | None
    seqused_k: torch.Tensor | None
    block_table: torch.Tensor | None
    max_q: int
    max_k: int
    # layer entry: the step's new K/V (token order, padding included) and each sequence's pages
    new_k: torch.Tensor | None = None
    new_v: torch.Tensor | None = None
    tables: list[list[int]] | None = None


def _generator(device: torch.device | str, seed: int) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


def draw_data(case: Case, device) -> SeqData:
    c = case.config
    g = _generator(device, case.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(c.dtype)

    qs = [randn(q, c.num_heads, c.head_dim) for q, _ in case.seqlens]
    ks = [randn(k, c.num_kv_heads, c.head_dim) for _, k in case.seqlens]
    vs = [randn(k, c.num_kv_heads, c.head_dim) for _, k in case.seqlens]
    return SeqData(qs, ks, vs, randn(case.extra_rows, c.num_heads, c.head_dim))


def pack(case: Case, data: SeqData, device) -> Packed:
    c = case.config
    g = _generator(device, case.seed + 1)
    rng = random.Random(case.seed)
    kvh, d = c.num_kv_heads, c.head_dim
    q_lens = [q for q, _ in case.seqlens]
    k_lens = [k for _, k in case.seqlens]
    as_int32 = dict(dtype=torch.int32, device=device)
    cu_q = torch.tensor([0] + list(itertools.accumulate(q_lens)), **as_int32)
    q = torch.cat(data.qs + [data.q_tail])
    max_q, max_k = max(q_lens), max(k_lens)

    def garbage(*shape):
        return (GARBAGE * torch.randn(*shape, generator=g, device=device)).to(c.dtype)

    if not c.paged:
        pads = [rng.randint(0, 3) if c.layout == "contiguous+seqused" else 0 for _ in k_lens]
        k = torch.cat([t for kk, p in zip(data.ks, pads) for t in (kk, garbage(p, kvh, d))])
        v = torch.cat([t for vv, p in zip(data.vs, pads) for t in (vv, garbage(p, kvh, d))])
        cu_k = torch.tensor([0] + list(itertools.accumulate(n + p for n, p in zip(k_lens, pads))), **as_int32)
        used = torch.tensor(k_lens, **as_int32) if c.layout == "contiguous+seqused" else None
        return Packed(q, k, v, cu_q, cu_k, used, None, max_q, max_k)

    page = c.page_size
    needed = [-(-n // page) for n in k_lens]
    poison = 2  # pages no sequence owns: where unused block-table entries point
    num_blocks = sum(needed) + poison
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(case.seed)).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n
    spare = order[start:]
    # Width a multiple of 16 with at least one unused column: one Triton specialisation of the
    # table stride, and an unused entry in every row.
    width = -(-(max(needed) + 1) // 16) * 16
    table = torch.tensor([t + [rng.choice(spare) for _ in range(width - len(t))] for t in tables], **as_int32)
    kc = garbage(num_blocks, page, kvh, d)
    vc = garbage(num_blocks, page, kvh, d)
    layer = case.entry == "layer"
    for t, kk, vv, (ql, kl) in zip(tables, data.ks, data.vs, case.seqlens):
        n = kl - ql if layer else kl  # the layer op writes this step's K/V itself
        if n:
            slots = torch.tensor([t[p // page] * page + p % page for p in range(n)], device=device)
            kc.view(-1, kvh, d)[slots] = kk[:n]
            vc.view(-1, kvh, d)[slots] = vv[:n]
    packed = Packed(q, kc, vc, cu_q, None, torch.tensor(k_lens, **as_int32), table, max_q, max_k, tables=tables)
    if layer:
        packed.new_k = torch.cat([kk[kl - ql:] for kk, (ql, kl) in zip(data.ks, case.seqlens)]
                                 + [garbage(case.extra_rows, kvh, d)])
        packed.new_v = torch.cat([vv[kl - ql:] for vv, (ql, kl) in zip(data.vs, case.seqlens)]
                                 + [garbage(case.extra_rows, kvh, d)])
    return packed


# ---------------------------------------------------------------------------------------------
# reference and judging


def visible_keys(q_len: int, k_len: int, causal: bool, window_left: int, device) -> torch.Tensor:
    """(q_len, k_len) bool: query i (at position k_len - q_len + i) may see key p."""
    qpos = torch.arange(q_len, device=device).unsqueeze(1) + (k_len - q_len)
    kpos = torch.arange(k_len, device=device).unsqueeze(0)
    seen = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        seen &= kpos <= qpos
    if window_left >= 0:
        seen &= kpos >= qpos - window_left
    return seen


def attention_ref(q, k, v, *, scale: float, causal: bool, window_left: int, softcap: float,
                  compute_dtype: torch.dtype, alibi_slopes: Sequence[float] | None = None) -> torch.Tensor:
    """One sequence, computed in ``compute_dtype`` (float64: the reference; the kernel's dtype: the
    low-precision reference, as FlashAttention's ``attention_ref(..., upcast=False)``).

    q (Lq, H, D), k/v (Lk, KVH, D) -> (Lq, H, D) in ``compute_dtype``. NaN/Inf propagate as in
    SDPA; a query that sees no key outputs zeros.
    """
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q * scale, k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    seen = visible_keys(q.shape[0], k.shape[0], causal, window_left, q.device)
    if alibi_slopes is not None:
        qpos = torch.arange(q.shape[0], device=q.device).view(-1, 1) + (k.shape[0] - q.shape[0])
        dist = (qpos - torch.arange(k.shape[0], device=q.device).view(1, -1)).abs().to(compute_dtype)
        slopes = torch.tensor(alibi_slopes, dtype=compute_dtype, device=q.device).view(-1, 1, 1)
        scores = scores - slopes * dist
    attn = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", attn, v)
    return out.masked_fill(~seen.any(dim=-1).view(-1, 1, 1), 0.0)


def _where(mask: torch.Tensor) -> str:
    idx = mask.nonzero()[0].tolist()
    return f"(row {idx[0]}, head {idx[1]}, dim {idx[2]})"


def judge_sequence(got: torch.Tensor, q, k, v, case: Case, oracle=None) -> str | None:
    """None if ``got`` (Lq, H, D) is right for one sequence of ``case``, else what is wrong.

    ``oracle(q, k, v, scale=, causal=, window_left=, softcap=, alibi_slopes=)`` gives the float64 answer;
    default: ``attention_ref`` in float64.
    """
    c = case.config
    kw = dict(scale=case.softmax_scale, causal=c.causal, window_left=case.window_left, softcap=c.softcap,
              alibi_slopes=c.alibi_slopes)
    if oracle is None:
        want = attention_ref(q, k, v, compute_dtype=torch.float64, **kw)
    else:
        want = oracle(q, k, v, **kw).to(got.device)
    low = attention_ref(q, k, v, compute_dtype=c.dtype, **kw).double()
    got = got.double()
    for name, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        differ = test(got) != test(want)
        if differ.any():
            return (f"{int(differ.sum())} outputs are {name} where the reference is not, or the other way "
                    f"round (first at {_where(differ)}; reference there: "
                    f"{want[differ][0].item()!r}, output: {got[differ][0].item()!r})")
    blind = ~visible_keys(q.shape[0], k.shape[0], c.causal, case.window_left, q.device).any(dim=-1)
    if blind.any() and (got[blind] != 0).any():
        return f"rows {blind.nonzero().flatten().tolist()[:8]} see no key but are not all zero"
    finite = torch.isfinite(want)
    if not finite.any():
        return None
    err = (got - want).abs().masked_fill(~finite, 0)
    low_err = (low - want).abs().masked_fill(~finite, 0).nan_to_num(0.0, posinf=0.0)
    factor = 3 if c.softcap else 2
    bound = factor * low_err.max().item() + ABS_SLACK
    if err.max().item() > bound:
        worst = err == err.max()
        return (f"max |out - ref| = {err.max().item():.3g} at {_where(worst)} exceeds {factor} x "
                f"{low_err.max().item():.3g} (the {c.dtype} reference's error) + {ABS_SLACK:g}")
    return None


def judge(out: torch.Tensor, case: Case, data: SeqData, what: str, oracle=None) -> None:
    """Assert ``out`` (the packed output of ``case``) is right; the message names the case."""
    problems = []
    start = 0
    for i, ((ql, kl), q, k, v) in enumerate(zip(case.seqlens, data.qs, data.ks, data.vs)):
        if ql:
            why = judge_sequence(out[start:start + ql], q, k, v, case, oracle)
            if why is not None:
                problems.append(f"  sequence {i} (q_len {ql}, k_len {kl}): {why}")
        start += ql
    tail = out[start:]
    if tail.numel() and (tail != 0).any():
        problems.append(f"  the {tail.shape[0]} rows past the last sequence are not all zero")
    if problems:
        raise AssertionError(f"{what} gives a wrong answer for {case.describe()}:\n" + "\n".join(problems))
