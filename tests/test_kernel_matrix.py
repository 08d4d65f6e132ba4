"""Every attention backend on a wide, seeded matrix of cases, judged as FlashAttention judges itself.

- GPU (``-m cuda``): ``reference``, ``triton`` and ``flash`` on the same seeded sample (see
  ``matrix_cases``: configs covering every pair of values of dtype x head dim x MHA/GQA/MQA x causal x
  window x softcap x contiguous/paged K/V at page sizes 1-256; many shapes each: q > k, odd and
  prime lengths, 1-token queries, q == k up to 2048), each case its own test. A backend runs only
  what its ``unsupported_reason`` accepts; a refused case is skipped with the backend's reason,
  and ``test_refusals_match_documentation_*`` checks that refusals are exactly the documented ones.
  Only the matrix: ``pytest -m cuda tests/test_kernel_matrix.py``; in parallel (each kernel
  configuration compiles once, on one worker): add ``-n 8 --dist loadgroup`` (pytest-xdist).
- CPU: ``reference`` against the float64 oracle of tests/naive.py; ``triton`` under the Triton
  interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
- Non-finite inputs: NaN/Inf in q, k or v reach exactly the rows that see them; a query that sees
  no key is zero; through the varlen entry and the per-layer op, decode and mixed steps.
"""
from __future__ import annotations

import os
import random
import types
from typing import NamedTuple

import fa4_sm90
import naive
import pytest
import torch

import compileattn
from compileattn import AttentionMetadataBuilder, AttentionSpec, KVCache, SequenceStep, set_forward_context
from compileattn.kv_cache import SUPPORTED_HEAD_DIMS
from matrix_cases import (
    CPU_SHAPES, GPU_SHAPES, Case, Config, attention_ref, covering_configs, draw_data, judge, pack, sample_cases,
)

# =============================================================================================
# Adapter: the only code in this module that knows how a backend is reached.
# =============================================================================================

CUDA = torch.cuda.is_available()
#: Block size the selector reports to ``unsupported_reason`` for contiguous K/V.
CONTIGUOUS_BLOCK_SIZE = 0


def backend(name: str, device) -> object:
    """The selector's backend ``name`` for ``device`` (ImportError if its package is missing)."""
    from compileattn.backends import selector

    return selector.get_backend(name, device)


def refusal(be, config: Config, device, window_left: int = -1) -> str | None:
    """``be``'s own verdict on ``config``: None if it runs it, else its reason.

    Head dims outside SUPPORTED_HEAD_DIMS cannot be put in an AttentionSpec (it validates), so
    they are asked with a look-alike carrying the same fields.
    """
    fields = dict(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                  sliding_window=window_left, softcap=config.softcap, causal=config.causal,
                  alibi_slopes=config.alibi_slopes)
    if config.head_dim in SUPPORTED_HEAD_DIMS:
        spec = AttentionSpec(**fields)
    else:
        spec = types.SimpleNamespace(scale=config.head_dim ** -0.5, **fields)
    block_size = config.page_size if config.paged else CONTIGUOUS_BLOCK_SIZE
    cache_dtype = torch.float8_e4m3fn if config.kv_fp8 else config.dtype
    return be.unsupported_reason(spec, config.dtype, torch.device(device), block_size, cache_dtype=cache_dtype)


def run_backend(name: str, case: Case, t, device) -> torch.Tensor:
    """Backend ``name``'s output for ``case`` (tensors ``t`` from ``matrix_cases.pack``), through the
    public varlen entry or the per-layer op with a forward context, as ``case.entry`` says."""
    c = case.config
    out = torch.full_like(t.q, float("nan"))  # a row the backend does not write stays NaN
    if case.entry == "varlen":
        causal, right = (False, 0) if case.causal_as_window else (c.causal, -1)
        slopes = None if c.alibi_slopes is None else torch.tensor(c.alibi_slopes, dtype=torch.float32, device=device)
        compileattn.flash_attn_varlen_func(
            t.q, t.k, t.v, t.cu_q, t.cu_k, t.max_q, t.max_k, softmax_scale=case.scale, causal=causal,
            window_size=(case.window_left, right), softcap=c.softcap, alibi_slopes=slopes, block_table=t.block_table,
            seqused_k=t.seqused_k, out=out, backend=name)
        return out
    spec = AttentionSpec(c.num_heads, c.num_kv_heads, c.head_dim, case.scale, case.window_left, c.softcap, c.causal,
                         c.alibi_slopes)
    builder = AttentionMetadataBuilder(block_size=c.page_size, num_blocks=t.k.shape[0],
                                       max_num_tokens=t.q.shape[0] + 8, max_blocks_per_seq=t.block_table.shape[1],
                                       device=device, backend=name)
    steps = [SequenceStep(ql, kl - ql, table) for (ql, kl), table in zip(case.seqlens, t.tables)]
    md = builder.build(steps, pad_to=t.q.shape[0])
    cache = KVCache(t.k.clone(), t.v.clone(), spec)
    with set_forward_context(md, {"layer": cache}):
        torch.ops.compileattn.attention(t.q, t.new_k, t.new_v, out, "layer")
    return out


def fake_gpu_backend(name: str, monkeypatch, capability, flash_impl: str | None = None):
    """A fresh backend ``name`` for device "cuda" on a machine whose CUDA answers are faked:
    ``capability`` None means CUDA is unavailable. ``flash`` gets FlashAttention ``flash_impl``
    ("fa4"/"fa2") with its import faked, which its support checks never call into."""
    from compileattn.backends import flash_fa2, flash_fa4, reference

    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    if name == "flash":
        monkeypatch.setattr(flash_fa4, "load", fa4_sm90.faked_interface)
        monkeypatch.setattr(flash_fa2, "load", lambda: (types.SimpleNamespace(), "2.7.0"))
        return flash_fa4.FA4Backend("cuda") if flash_impl == "fa4" else flash_fa2.FA2Backend("cuda")
    if name == "triton":
        from compileattn.backends.triton.backend import TritonBackend

        return TritonBackend("cuda")
    return reference.ReferenceBackend("cuda")


def flash_implementation(device) -> str:
    """"fa4" or "fa2": which FlashAttention the ``flash`` backend loaded on ``device``."""
    return {"FlashAttention-4": "fa4", "FlashAttention-2": "fa2"}[backend("flash", device).label]


# =============================================================================================
# The documented refusals, restated (docstrings and comments of each unsupported_reason).
# =============================================================================================


class Where(NamedTuple):
    """Where a support question is asked."""

    device_type: str  # "cpu", "cuda" or another torch device type
    capability: tuple[int, int] | None = None  # CUDA compute capability; None: no CUDA
    interpreting: bool = False  # TRITON_INTERPRET=1
    flash_impl: str = "fa4"


FP16_BF16 = (torch.float16, torch.bfloat16)


def documented_refusal(name: str, where: Where, config: Config) -> str | None:
    """A word of the reason backend ``name`` documents for refusing ``config`` at ``where``, or None.

    Adding a refusal to a backend means adding it here (with the tests it brings): the matrix and
    ``test_refusals_match_documentation_*`` fail on any refusal this function does not list.
    """
    d, dtype = config.head_dim, config.dtype
    block_size = config.page_size if config.paged else CONTIGUOUS_BLOCK_SIZE
    if name == "reference":
        return None
    if name == "triton":
        if where.device_type == "cuda":
            if where.capability is None:
                return "CUDA is not available"
            if where.capability < (8, 0):
                return "compute capability 8.0"
            if config.kv_fp8 and where.capability < (8, 9):
                return "compute capability 8.9"
        elif where.device_type == "cpu":
            if not where.interpreting:
                return "TRITON_INTERPRET=1"
            if dtype == torch.bfloat16:
                return "bf16"
        else:
            return "no Triton target"
        if d not in SUPPORTED_HEAD_DIMS:
            return "head_dim"
        return None
    if name == "flash" and where.flash_impl == "fa4":
        if where.device_type != "cuda":
            return "needs a CUDA device"
        if dtype not in FP16_BF16:
            return "float16/bfloat16"
        if config.kv_fp8:
            return "fp8 path needs q, k and v all fp8"
        if config.alibi:
            return "no ALiBi"
        family = where.capability[0]
        if family not in (9, 10, 11):
            return "paged KV only on SM90/SM100/SM110"
        if d % 8 or not 8 <= d <= 256:
            return "head_dim in [8, 256] divisible by 8"
        if family in (10, 11) and not (d <= 128 or d == 256):
            return "head_dim <= 128 or 256"
        if family == 9 and block_size and d % 16:
            return "not a multiple of 16"
        window = 5 if config.windowed else -1
        if family == 9 and fa4_sm90.paged_loader_overruns(d, config.causal, window, block_size):
            return "wrong results for paged KV"
        return None
    if name == "flash" and where.flash_impl == "fa2":
        if where.device_type != "cuda":
            return "needs a CUDA device"
        if dtype not in FP16_BF16:
            return "float16/bfloat16"
        if config.kv_fp8:
            return "reads K/V in the queries' dtype only"
        if where.capability[0] < 8:
            return "SM80 or newer"
        if block_size % 256:
            return "divisible by 256"
        if d > 256 or d % 8:
            return "head_dim <= 256 divisible by 8"
        return None
    raise ValueError(f"no documented rules for {name!r} at {where}")


#: Asked of every backend: the matrix's axes and past their edges (head dims no AttentionSpec
#: accepts, block size 0, float32).
REFUSAL_PRODUCT = [
    Config(dtype, d, h, kvh, causal, windowed, softcap, layout)
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for d in SUPPORTED_HEAD_DIMS + (8, 36, 48, 264)
    for h, kvh in ((4, 4), (8, 2), (8, 1))
    for causal in (True, False)
    for windowed in (False, True)
    for softcap in (0.0, 5.0)
    for layout in ("contiguous", 1, 16, 32, 64, 112, 128, 144, 256, 512)
] + [  # ALiBi and fp8 KV caches, over fewer of the other axes
    Config(dtype, d, h, kvh, causal, False, softcap, layout, alibi, kv_fp8)
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for d in (64, 96, 128, 256, 36)
    for h, kvh in ((4, 4), (8, 2))
    for causal in (True, False)
    for softcap in (0.0, 5.0)
    for layout in ("contiguous", 16, 128, 144)
    for alibi, kv_fp8 in ((True, False), (False, True), (True, True))
]


def assert_refusals_documented(be, name: str, where: Where, device) -> None:
    wrong = []
    for config in REFUSAL_PRODUCT:
        got = refusal(be, config, device, 5 if config.windowed else -1)
        want = documented_refusal(name, where, config)
        if (got is None) != (want is None) or (want is not None and want not in got):
            wrong.append(f"{config.describe()}: backend says {got!r}, documented: {want!r}")
    assert not wrong, f"{name} at {where}: {len(wrong)} refusals differ from the documented ones:\n" + "\n".join(
        wrong[:20])


# =============================================================================================
# GPU matrix
# =============================================================================================

BACKENDS = ("reference", "triton", "flash")
#: Another value draws another sample (every process of one run must see the same value).
SEED = int(os.environ.get("COMPILEATTN_MATRIX_SEED", "2024"))
GPU_AXES = dict(
    dtype=FP16_BF16,
    head_dim=(64, 80, 96, 128, 192, 256),
    heads=((4, 4), (4, 2), (6, 2), (16, 2), (8, 1)),  # MHA, GQA 2/3/8, MQA
    causal=(True, False),
    windowed=(False, True),
    softcap=(0.0, 5.0),
    layout=("contiguous", "contiguous+seqused", 1, 16, 32, 64, 128, 256),
    alibi=(False, True),
)
GPU_CONFIGS = covering_configs(GPU_AXES, random.Random(SEED))
GPU_CASES = sample_cases(GPU_CONFIGS, per_config=12, pool=GPU_SHAPES, seed=SEED)


def _matrix_params(cases, configs, backends):
    group = {config: i for i, config in enumerate(configs)}
    return [pytest.param(name, case, id=f"{name}-{case.case_id}",
                         marks=pytest.mark.xdist_group(f"{name}-{group[case.config]}"))
            for name in backends for case in cases]


def _backend_or_skip(name: str, device):
    try:
        return backend(name, device)
    except ImportError as exc:
        pytest.skip(f"backend {name!r} is not importable here: {exc}")


def run_and_judge(name: str, case: Case, device, oracle=None) -> None:
    """Run ``case`` on backend ``name`` if it accepts it (else skip with its reason) and judge it."""
    reason = refusal(_backend_or_skip(name, device), case.config, device, case.window_left)
    if reason is not None:
        pytest.skip(f"{name} refuses {case.config.describe()}: {reason}")
    data = draw_data(case, device)
    out = run_backend(name, case, pack(case, data, device), device)
    judge(out, case, data, f"backend {name!r}", oracle)


def test_gpu_sample_is_wide():
    """The sample covers every value of every axis, and >= 500 cases per backend."""
    assert len(GPU_CASES) >= 500
    for axis, values in GPU_AXES.items():
        seen = {(c.num_heads, c.num_kv_heads) if axis == "heads" else getattr(c, axis) for c in GPU_CONFIGS}
        assert seen == set(values), axis
    lens = [qk for case in GPU_CASES for qk in case.seqlens]
    assert any(q > k for q, k in lens) and any(q == 1 for q, _ in lens) and (2048, 2048) in lens
    assert any(q == k and q % 2 for q, k in lens) and {"varlen", "layer"} == {c.entry for c in GPU_CASES}
    assert {0} < {c.window_left for c in GPU_CASES}


@pytest.mark.cuda
@pytest.mark.parametrize(("name", "case"), _matrix_params(GPU_CASES, GPU_CONFIGS, BACKENDS))
def test_gpu_matrix(name, case):
    run_and_judge(name, case, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("name", BACKENDS)
def test_refusals_match_documentation_on_this_gpu(name):
    be = _backend_or_skip(name, "cuda")
    impl = flash_implementation("cuda") if name == "flash" else "fa4"
    assert_refusals_documented(be, name, Where("cuda", torch.cuda.get_device_capability(), False, impl), "cuda")


# =============================================================================================
# CPU matrices
# =============================================================================================

CPU_AXES = dict(
    dtype=(torch.float16, torch.bfloat16, torch.float32),
    head_dim=SUPPORTED_HEAD_DIMS,
    heads=((2, 2), (4, 2), (6, 2), (8, 1)),
    causal=(True, False),
    windowed=(False, True),
    softcap=(0.0, 5.0),
    layout=("contiguous", "contiguous+seqused", 1, 16, 32, 64, 128, 256),
    alibi=(False, True),
)
CPU_CONFIGS = covering_configs(CPU_AXES, random.Random(SEED + 1))
CPU_CASES = sample_cases(CPU_CONFIGS, per_config=3, pool=CPU_SHAPES, seed=SEED + 1)
#: The interpreter costs ~0.1-1 s a case: one case per config, fp16/fp32 (its bf16 dot is wrong).
INTERPRETER_AXES = dict(CPU_AXES, dtype=(torch.float16, torch.float32), head_dim=(64, 80, 96, 128, 192, 256))
INTERPRETER_CONFIGS = covering_configs(INTERPRETER_AXES, random.Random(SEED + 2))
INTERPRETER_CASES = sample_cases(INTERPRETER_CONFIGS, per_config=1, pool=CPU_SHAPES, seed=SEED + 2)

needs_interpreter = pytest.mark.skipif(CUDA, reason="interpreter tests (the GPU runs the compiled kernels)")


def naive_oracle(q, k, v, *, scale, causal, window_left, softcap, alibi_slopes=None):
    return naive.attend(q.cpu(), k.cpu(), v.cpu(), scale=scale, causal=causal, window_left=window_left,
                        softcap=softcap, alibi_slopes=alibi_slopes)


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.case_id for c in CPU_CASES])
def test_cpu_reference_matrix(case):
    """The reference backend against the float64 oracle (tests/naive.py), FlashAttention's rule."""
    run_and_judge("reference", case, "cpu", oracle=naive_oracle)


def test_float64_reference_is_the_oracle():
    """The GPU matrix's float64 reference (``attention_ref``) equals tests/naive.py."""
    for case in CPU_CASES[::7]:
        data = draw_data(case, "cpu")
        c = case.config
        kw = dict(scale=case.softmax_scale, causal=c.causal, window_left=case.window_left, softcap=c.softcap,
                  alibi_slopes=c.alibi_slopes)
        for q, k, v in zip(data.qs, data.ks, data.vs):
            torch.testing.assert_close(attention_ref(q, k, v, compute_dtype=torch.float64, **kw),
                                       naive.attend(q, k, v, **kw), atol=1e-12, rtol=1e-12)


@needs_interpreter
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=[c.case_id for c in INTERPRETER_CASES])
def test_interpreter_triton_matrix(case):
    run_and_judge("triton", case, "cpu")


# =============================================================================================
# Refusals: exactly the documented ones
# =============================================================================================


def test_reference_refuses_nothing():
    for device in ("cpu", "cuda"):
        assert_refusals_documented(backend("reference", "cpu"), "reference", Where(device), device)


@pytest.mark.parametrize("interpret", [True, False], ids=["interpreter", "compiled"])
def test_triton_refusals_on_cpu(interpret, monkeypatch):
    """On the CPU the Triton backend runs fp16/fp32 under the interpreter, nothing else."""
    be = backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    from compileattn.backends.triton import _mode

    assert _mode.interpreting() is interpret
    assert_refusals_documented(be, "triton", Where("cpu", interpreting=interpret), "cpu")
    assert_refusals_documented(be, "triton", Where("meta"), "meta")


@pytest.mark.parametrize("capability", [None, (7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)], ids=str)
def test_triton_refusals_on_faked_gpus(capability, monkeypatch):
    be = fake_gpu_backend("triton", monkeypatch, capability)
    assert_refusals_documented(be, "triton", Where("cuda", capability), "cuda")


@pytest.mark.parametrize("impl", ["fa4", "fa2"])
@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (11, 0), (12, 0)], ids=str)
def test_flash_refusals_on_faked_gpus(impl, capability, monkeypatch):
    """FlashAttention's rules per GPU generation, checked here with the GPU and the package faked."""
    be = fake_gpu_backend("flash", monkeypatch, capability, impl)
    where = Where("cuda", capability, flash_impl=impl)
    assert_refusals_documented(be, "flash", where, "cuda")
    assert_refusals_documented(be, "flash", where._replace(device_type="cpu"), "cpu")


# =============================================================================================
# NaN and Inf: they reach exactly the rows that see them; a query that sees no key is zero
# =============================================================================================

#: (name, entry, layout, seqlens): mixed steps with queries that see nothing (q > k), decode steps
#: (the Triton decode kernel, split over the keys), both through the per-layer op.
NONFINITE_STEPS = [
    ("varlen-mixed", "varlen", "contiguous", ((5, 9), (4, 4), (6, 3))),
    ("varlen-decode", "varlen", 16, ((1, 9), (1, 40), (1, 3))),
    ("layer-mixed", "layer", 16, ((5, 9), (4, 4), (1, 20))),
    ("layer-decode", "layer", 16, ((1, 9), (1, 40), (1, 3))),
]


def _inject(kind: str, data) -> None:
    """Put NaN/Inf where the reference's answer is known: every place chosen is seen by some query
    (so the answer must be non-finite there) and the rows that do not see it must stay finite.

    NaN in v goes at key 0, which every query that sees anything sees: a masked-off NaN value can
    leak through ``p = 0`` times NaN in any implementation that loads its tile (SDPA too), so only
    the rows that see it are defined.
    """
    qs, ks, vs = data.qs, data.ks, data.vs
    nan, inf = float("nan"), float("inf")
    blind = [i for i, (q, k) in enumerate(zip(qs, ks)) if q.shape[0] > k.shape[0]]
    if kind == "nan_q":
        qs[0][-1, 1, 3] = nan
        for i in blind:
            qs[i][0, 0, 0] = nan  # a query that sees no key: still zero
    elif kind == "nan_k":
        ks[0][-3, 0, 5] = nan  # seen by the last 3 queries of a causal step, not by earlier ones
        ks[1][1, 1, 2] = nan
    elif kind == "nan_v":
        vs[0][0, 1, 7] = nan
        for i in blind:
            vs[i][0, 0, 0] = nan
    elif kind == "inf_k":
        qs[0][:, :, 5] = qs[0][:, :, 5].abs()
        ks[0][-3, 0, 5] = inf  # +inf scores: NaN rows (inf - inf)
        qs[1][:, :, 4] = qs[1][:, :, 4].abs()
        ks[1][-1, 1, 4] = -inf  # -inf scores: the key is ignored
    elif kind == "inf_q":
        ks[0][:, 1, 1] = ks[0][:, 1, 1].abs()
        qs[0][-1, 2, 1] = inf
    else:
        raise ValueError(kind)


NONFINITE_KINDS = ("nan_q", "nan_k", "nan_v", "inf_k", "inf_q")


def run_nonfinite(name: str, step, kind: str, dtype, device) -> None:
    label, entry, layout, seqlens = step
    config = Config(dtype, 64, 4, 2, True, False, 0.0, layout)
    case = Case(0, config, seqlens, -1, None, entry, 2 if entry == "layer" else 0, False, seed=7)
    if refusal(_backend_or_skip(name, device), config, device) is not None:
        pytest.skip(f"{name} refuses {config.describe()}")
    data = draw_data(case, device)
    _inject(kind, data)
    kw = dict(scale=case.softmax_scale, causal=True, window_left=-1, softcap=0.0)
    wants = [attention_ref(q, k, v, compute_dtype=torch.float64, **kw) for q, k, v in zip(data.qs, data.ks, data.vs)]
    assert any(w.isnan().any() for w in wants), "the injection must reach some query"
    out = run_backend(name, case, pack(case, data, device), device)
    if name == "flash" and kind == "nan_v" and layout == "contiguous":
        out = _forgive_tile_leak(out, wants)
    judge(out, case, data, f"backend {name!r} with {kind} ({label})")


def _forgive_tile_leak(out: torch.Tensor, wants: list[torch.Tensor]) -> torch.Tensor:
    """FlashAttention loads whole K/V tiles; with contiguous varlen K/V a tile runs on into the next
    sequences' keys, and a NaN value there reaches other rows as ``p = 0`` times NaN (seen on the
    H200 with FlashAttention-4). Every NaN the reference has must still be there; the extra ones
    are replaced by the reference, so the rest of the output is judged as strictly as before."""
    want = torch.cat(wants).to(out.device)
    missing = torch.isnan(want) & ~torch.isnan(out[: want.shape[0]])
    assert not missing.any(), "a NaN the reference has was dropped"
    leaked = torch.isnan(out[: want.shape[0]]) & ~torch.isnan(want)
    fixed = out.clone()
    fixed[: want.shape[0]][leaked] = want[leaked].to(out.dtype)
    return fixed


@pytest.mark.parametrize("kind", NONFINITE_KINDS)
@pytest.mark.parametrize("step", NONFINITE_STEPS, ids=[s[0] for s in NONFINITE_STEPS])
def test_nonfinite_reference_cpu(step, kind):
    run_nonfinite("reference", step, kind, torch.float16, "cpu")


@needs_interpreter
@pytest.mark.parametrize("kind", NONFINITE_KINDS)
@pytest.mark.parametrize("step", NONFINITE_STEPS, ids=[s[0] for s in NONFINITE_STEPS])
def test_interpreter_triton_nonfinite(step, kind):
    run_nonfinite("triton", step, kind, torch.float16, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kind", NONFINITE_KINDS)
@pytest.mark.parametrize("step", NONFINITE_STEPS, ids=[s[0] for s in NONFINITE_STEPS])
def test_nonfinite_gpu(name, step, kind):
    run_nonfinite(name, step, kind, torch.bfloat16, "cuda")


def test_inf_k_case_is_not_vacuous():
    """inf_k's -inf key must change the answer (else ignoring it would be untested)."""
    config = Config(torch.float32, 64, 4, 2, True, False, 0.0, "contiguous")
    case = Case(0, config, ((5, 9), (4, 4)), -1, None, "varlen", 0, False, seed=7)
    data = draw_data(case, "cpu")
    kw = dict(scale=case.softmax_scale, causal=True, window_left=-1, softcap=0.0)
    before = attention_ref(data.qs[1], data.ks[1], data.vs[1], compute_dtype=torch.float64, **kw)
    _inject("inf_k", data)
    after = attention_ref(data.qs[1], data.ks[1], data.vs[1], compute_dtype=torch.float64, **kw)
    assert after.isfinite().all() and not torch.allclose(before[-1], after[-1])


def test_injections_cover_each_tensor():
    """Each kind puts its non-finite values where documented (guards edits of ``_inject``)."""
    config = Config(torch.float32, 64, 4, 2, True, False, 0.0, "contiguous")
    case = Case(0, config, ((5, 9), (4, 4), (6, 3)), -1, None, "varlen", 0, False, seed=7)
    for kind, tensor in zip(NONFINITE_KINDS, ("qs", "ks", "vs", "ks", "qs")):
        data = draw_data(case, "cpu")
        _inject(kind, data)
        assert any((~torch.isfinite(t)).any() for t in getattr(data, tensor)), kind

