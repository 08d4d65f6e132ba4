"""FlashAttention-4 (``flash_attn.cute``, PyPI ``flash-attn-4``): support checks, the public call,
and the cached compiled kernel called directly.

Why not just call ``flash_attn_varlen_func``: on the H200 host its Python entry costs ~90-100 µs of
CPU per call, almost all of it argument processing and building a ~60-field compile key
(``interface._flash_attn_fwd``, flash-attn-4 4.0.0b36 ``flash_attn/cute/interface.py`` l.678-1522),
while the kernel it finally launches (l.1936: ``_flash_attn_fwd.compile_cache[compile_key](*call_args)``)
costs 8.5 µs when called directly. Everything the entry computes depends only on shapes and
configuration, so it is done once per kernel key here and the per-layer call is that last line.

The compiled-call convention (4.0.0b36):

- The cache (``_flash_attn_fwd.compile_cache``, ``cache_utils.JITCache``, l.1969) maps the compile
  key to what ``cute.compile(..., options="--enable-tvm-ffi")`` returned (l.1845): a TVM-FFI
  function (``cutlass_dsl/tvm_ffi_provider.py`` ``TVMFFIJitCompiledFunctionWithKwargs``, or a bare
  ``tvm_ffi.Function`` when loaded from FA4's on-disk cache).
- It takes **torch tensors** (converted through DLPack per call, no cute tensor wrappers) and
  Python scalars, positionally, with no stream argument: the kernel was compiled against
  ``make_fake_stream(use_tvm_ffi_env_stream=True)`` (l.1524) and launches on the stream TVM-FFI
  reads from torch for the first CUDA tensor argument (``torch.cuda.current_stream()``; tvm_ffi
  ``cython/function.pxi``), so it is captured by ``torch.cuda.graph`` like any torch kernel.
- The argument list (l.1887-1934): ``q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k,
  seqused_q, seqused_k, page_table, window_size_left, window_size_right, learnable_sink``, then on
  SM100/110 ``descale_tensors``, then ``block_sparse_tensors, AuxData(aux_tensors, aux_scalars)``,
  then on SM90 ``cu_total_m_blocks, cu_total_splits_m_blocks`` and on SM100/110 seven scheduler
  tensors and ``max_seqlen_q`` (a runtime Int32 that sizes the grid). ``ARG_LAYOUTS`` spells
  this out per arch.

How the kernel and its arguments are obtained: the first time a kernel key is prepared, FA4's own
entry runs once (on a zero query, into a scratch output, over the real caches and metadata) with
the compile cache wrapped (``_Recorder``), which records the compiled function and the exact
argument tuple FA4 built. That tuple is checked against ``ARG_LAYOUTS`` (every tensor must be
this call's q/k/v/out or one of the step's metadata tensors; every other slot must hold a constant
or ``None``). From then on a step binds the layout's metadata slots to its own persistent-buffer
views and each layer's prepared call is ``fn(q, k_cache, v_cache, out, *tail)``. A tuple that does not match
(another FA4 version; more than 256 sequences, where FA4 passes per-call scheduler tensors derived
from ``cu_seqlens_q``) sends that key to the public entry, logged once: slower, never wrong.

What the kernel key must contain (``FA4Backend.kernel_key``): the GPU's compute capability (FA4
compiles per arch, and the argument layout is per arch family); and FA4's compile key depends on host
values of the step only through ``max_seqlen_q`` (SM100 ``q_stage``; the static-persistent scheduler that
assumes one M block) and ``batch_size > 256`` (the scheduler hint). ``num_splits`` is pinned to 1,
so ``max_seqlen_k`` only bounds the grid and FA4 takes it from ``page_table.shape[1] * page_size``.
On SM90 FA4 has no split-KV at all (l.1631 asserts it), which is why its batch-1 decode is slow.
"""
from __future__ import annotations

import inspect
import logging
import math
from typing import Any, NamedTuple

import torch

from .base import AttentionBackend

logger = logging.getLogger("compileattn")

#: Sequences above which FA4 passes per-call scheduler tensors (``BIN_BATCH_SEARCH_THRESH``, l.82).
BIG_BATCH = 256

#: Argument slots of the compiled forward kernel per arch family (see module docstring).
#: Roles: "q"/"k"/"v"/"out" the call's tensors; "cu_q"/"used_k"/"table" the step's metadata;
#: "max_q" the step's max query length (a runtime Int32); "const" any non-tensor value kept as FA4
#: passed it (softmax scale, window sizes, AuxData); None a slot that must hold None.
_HEAD = ("q", "k", "v", "out", None, "const", "cu_q", None, None, "used_k", "table", "const", "const",
         None)
ARG_LAYOUTS = {
    9: _HEAD + (None, "const", None, None),
    10: _HEAD + (None, None, "const") + (None,) * 7 + ("max_q",),
}
ARG_LAYOUTS[11] = ARG_LAYOUTS[10]

_STEP_ROLES = ("cu_q", "used_k", "table")
_FWD_PARAMS = ("cu_seqlens_q", "seqused_k", "max_seqlen_q", "page_table", "softmax_scale", "causal",
               "softcap", "window_size_left", "window_size_right", "num_splits", "out")


def load():
    """The ``flash_attn.cute.interface`` module, or ImportError saying why it is unusable here."""
    try:
        from flash_attn.cute import interface  # noqa: PLC0415
    except Exception as exc:  # a CPU-only host fails inside cutlass/cuda imports, not only ImportError
        raise ImportError(f"flash_attn.cute (FlashAttention-4) is not importable: "
                          f"{type(exc).__name__}: {exc}") from exc
    return interface


class _Recorder:
    """Stands in for ``_flash_attn_fwd.compile_cache`` during one call of FA4's entry: lookups and
    inserts go to the real cache, and the function FA4 picks is wrapped so the call is recorded."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[Any, tuple]] = []

    def __contains__(self, key) -> bool:
        return key in self.inner

    def __setitem__(self, key, fn) -> None:
        self.inner[key] = fn

    def __getitem__(self, key):
        fn = self.inner[key]

        def record(*args):
            self.calls.append((fn, args))
            return fn(*args)

        return record

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _same_tensor(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def match_layout(args: tuple, layout: tuple, expected: dict) -> str | None:
    """None if FA4's recorded ``args`` fit ``layout`` given the role values in ``expected``, else why not.

    Tensors are compared by address, shape, stride and dtype: FA4 passes ``q.detach()`` (a new
    object, same memory), and a copy it made (misaligned input) must not be mistaken for ours.
    """
    if len(args) != len(layout):
        return f"FA4 passed {len(args)} arguments, layout expects {len(layout)}"
    for i, (arg, role) in enumerate(zip(args, layout)):
        if role is None:
            if arg is not None:
                return f"argument {i} is {type(arg).__name__}, expected None"
        elif role == "const":
            if isinstance(arg, torch.Tensor):
                return f"argument {i} is a tensor, expected a constant"
        elif role == "max_q":
            if arg != expected["max_q"]:
                return f"argument {i} is {arg!r}, expected max_seqlen_q={expected['max_q']}"
        elif not _same_tensor(arg, expected[role]):
            return f"argument {i} is not this call's {role}"
    return None


class Template(NamedTuple):
    """A learned kernel: call ``fn(q, k, v, out, *tail)`` with the step's tensors put into ``tail``.

    Holds no tensor: ``tail`` has None in the step's slots (``bind`` fills them). Templates are
    kept by the backend, which every builder in the process shares, so a tensor here would keep
    the learning builder's persistent buffers alive for the process's lifetime."""

    fn: Any
    tail: tuple  # args[4:] with None in the step's slots
    slots: tuple  # (index into tail, role) for the step's tensors


class FA4Backend(AttentionBackend):
    """``flash`` on FlashAttention-4: everything that knows FA4's Python internals."""

    name = "flash"
    label = "FlashAttention-4"
    #: The direct call launches a fixed grid for a fixed step shape and never reads device memory
    #: on the host. Its first preparation per kernel key runs FA4's entry (which JIT-compiles):
    #: the selector prepares calls outside any capture.
    capturable = True

    def __init__(self, device_type: str = "cuda"):
        super().__init__(device_type)
        self.fa = load()
        fwd = getattr(self.fa, "_flash_attn_fwd", None)
        params = set(inspect.signature(fwd).parameters) if fwd is not None else set()
        missing = [p for p in _FWD_PARAMS if p not in params]
        #: FA4's entry below the autograd Function, which takes a caller-owned ``out``; None if this
        #: FA4 version lacks it (then there is no direct path, and outputs are copied into ``out``).
        self.fwd = fwd if fwd is not None and not missing and hasattr(fwd, "compile_cache") else None
        self.fwd_missing = missing
        self._arch: dict[int, int] = {}
        #: kernel key (``kernel_key``) -> Template, or None where the direct call is unavailable
        #: (public entry). No tensors (``Template``); one entry per kernel configuration.
        self._templates: dict[tuple, Template | None] = {}
        self._warned: set[str] = set()

    # -- support -------------------------------------------------------------------------------

    def arch(self, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        arch = self._arch.get(index)
        if arch is None:
            major, minor = torch.cuda.get_device_capability(index)
            arch = self._arch[index] = major * 10 + minor
        return arch

    def unsupported_reason(self, spec, dtype: torch.dtype, device: torch.device, block_size: int,
                           cache_dtype: torch.dtype | None = None) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return f"FlashAttention-4 needs a CUDA device, got {device.type}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashAttention-4 runs float16/bfloat16 only, got {dtype}"
        if cache_dtype not in (None, dtype):
            # interface.py l.806 (q, k, v one dtype) and l.925 (fp8 only on SM100).
            return (f"FlashAttention-4 cannot read a {cache_dtype} KV cache with {dtype} queries: its fp8 path "
                    f"needs q, k and v all fp8 and runs on SM100 only")
        if spec.alibi_slopes is not None:
            # A score_mod could add the bias, but softcap already takes that hook (l.1103).
            return "FlashAttention-4 has no ALiBi (no alibi_slopes argument)"
        arch = self.arch(device)
        family = arch // 10
        if family not in ARG_LAYOUTS:
            # SM80/SM120 kernels assert page_table is None (interface.py l.1611, l.1754).
            return f"FlashAttention-4 has paged KV only on SM90/SM100/SM110, this GPU is SM{arch}"
        d = spec.head_dim
        if d % 8 or not 8 <= d <= 256:
            return f"FlashAttention-4 needs head_dim in [8, 256] divisible by 8, got {d}"
        if family in (10, 11) and not (d <= 128 or d == 256):
            return f"FlashAttention-4 on SM{arch} supports head_dim <= 128 or 256, got {d}"
        if family == 9 and block_size:
            return self._sm90_paged_loader_reason(spec, block_size)
        return None

    def _sm90_paged_loader_reason(self, spec, block_size: int) -> str | None:
        """FA4's SM90 paged-KV loader (``paged_kv.PagedKVManager.load_KV``, used when the page size is
        not the kernel's K/V tile height ``tile_n``) copies rows in waves of
        ``128 // (gcd(ceil16(d), 64) // 8)`` and checks each row against the sequence length only,
        never against ``tile_n`` (4.0.0b36 ``paged_kv.py`` l.225-236). Where the wave does not divide
        ``tile_n``, the last wave writes past the tile into the other pipeline stage and ``sQ``/``sP``:
        silently wrong output (head dim 96 non-causal: tile 144, wave 32, errors of 0.3-2.2), or an
        illegal address. The tile comes from FA4's own choice (``_tile_size_fwd_sm90``)."""
        d = spec.head_dim
        if d % 16:
            return f"FlashAttention-4 on SM90 asserts for paged KV with head_dim={d} (not a multiple of 16)"
        window = spec.sliding_window if spec.sliding_window >= 0 else None
        try:
            causal, local, _, _ = self.fa._resolve_causal_local_window(spec.causal, window, None)
            tile_n = self.fa._tile_size_fwd_sm90(d, d, causal, local).n_block_size
        except (AttributeError, TypeError, ValueError) as exc:
            return (f"cannot tell which K/V tile this FlashAttention-4 uses on SM90 ({exc}); its paged loader is "
                    f"wrong for tiles its row waves do not divide, so paged KV is refused")
        if block_size == tile_n:
            return None  # the page is the tile: TMA loads, not the row-wave loader
        wave = 128 // (math.gcd(d, 64) // 8)
        if tile_n % wave:
            return (f"FlashAttention-4 on SM90 computes wrong results for paged KV with head_dim={d}, "
                    f"causal={spec.causal}, sliding_window={spec.sliding_window}: its page loader copies "
                    f"{wave}-row waves past the {tile_n}-row K/V tile")
        return None

    # -- prepared calls ------------------------------------------------------------------------

    def kernel_key(self, spec, dtype, shape, device: torch.device) -> tuple:
        """What a learned template depends on (module docstring), with the device's compute
        capability: FA4 compiles per arch, and the argument layout differs between arch families,
        so a process driving GPUs of two kinds must not call one's kernel on the other."""
        return (self.arch(torch.device(device)), spec, dtype, shape.block_size, shape.max_query_len,
                shape.num_seqs > BIG_BATCH)

    def prepare_attend(self, shape, tensors, spec, dtype, key_cache, value_cache, buffers, kv_scales=None):
        step = {"cu_q": tensors.query_start_loc, "used_k": tensors.seq_lens, "table": tensors.block_table}
        key = self.kernel_key(spec, dtype, shape, key_cache.device)
        if key not in self._templates:
            self._templates[key] = self._learn(shape, step, spec, dtype, key_cache, value_cache)
        tpl = self._templates[key]
        if tpl is None:
            public = self.fwd_public
            args = (step["cu_q"], step["used_k"], step["table"], shape.max_query_len, spec.scale, spec.causal,
                    spec.sliding_window, spec.softcap)

            def attend_public(q, out):
                public(q, key_cache, value_cache, out, *args)
            return attend_public
        fn, tail = tpl.fn, self.bind(tpl, step)

        def attend(q, out):
            fn(q, key_cache, value_cache, out, *tail)

        return attend

    def _learn(self, shape, step, spec, dtype, key_cache, value_cache) -> Template | None:
        """Run FA4's entry once on a zero query, recording the kernel it launches; the template,
        or None (logged once) where the direct call is unavailable."""
        q = torch.zeros(shape.num_tokens, spec.num_heads, spec.head_dim, dtype=dtype, device=key_cache.device)
        out = torch.empty_like(q)
        tpl, why = self.learn(q, key_cache, value_cache, out, step["cu_q"], step["used_k"], step["table"],
                              shape.max_query_len, spec.scale, spec.causal, spec.sliding_window, spec.softcap,
                              key_cache.device)
        if why is not None:
            msg = (f"FlashAttention-4 direct call unavailable for {spec} (max_query_len={shape.max_query_len}, "
                   f"{shape.num_seqs} sequences): {why}; using its Python entry for this configuration")
            if msg not in self._warned:
                self._warned.add(msg)
                logger.warning(msg)
        return tpl

    def fwd_public(self, q, k, v, out, cu_q, used_k, table, max_q, scale, causal, window_left, softcap):
        """FA4's entry with ``out`` given (no autograd Function, no output copy); the slow, always
        correct path. Detached inputs keep FA4 from allocating an lse for autograd."""
        if self.fwd is None:
            res = self.fa.flash_attn_varlen_func(
                q.detach(), k, v, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=used_k,
                page_table=table, softmax_scale=scale, causal=causal,
                window_size=(None if window_left < 0 else window_left, None), softcap=softcap)
            out.copy_(res[0] if isinstance(res, tuple) else res)
            return
        self.fwd(q.detach(), k, v, cu_seqlens_q=cu_q, seqused_k=used_k, max_seqlen_q=max_q,
                 page_table=table, softmax_scale=scale, causal=causal, softcap=softcap,
                 window_size_left=None if window_left < 0 else window_left, window_size_right=None,
                 num_splits=1, out=out.detach())

    def learn(self, q, k, v, out, cu_q, used_k, table, max_q, scale, causal, window_left, softcap,
              device) -> tuple[Template | None, str | None]:
        """Run this call through FA4's entry, recording the kernel; (template, None) or (None, why)."""
        if self.fwd is None:
            self.fwd_public(q, k, v, out, cu_q, used_k, table, max_q, scale, causal, window_left, softcap)
            return None, f"this flash-attn-4 has no _flash_attn_fwd with {self.fwd_missing}"
        inner = self.fwd.compile_cache
        rec = _Recorder(inner)
        self.fwd.compile_cache = rec
        try:
            self.fwd_public(q, k, v, out, cu_q, used_k, table, max_q, scale, causal, window_left, softcap)
        finally:
            self.fwd.compile_cache = inner
        if len(rec.calls) != 1:
            return None, f"FA4 made {len(rec.calls)} kernel calls (expected 1)"
        fn, args = rec.calls[0]
        layout = ARG_LAYOUTS[self.arch(device) // 10]
        expected = {"q": q, "k": k, "v": v, "out": out, "cu_q": cu_q, "used_k": used_k, "table": table,
                    "max_q": max_q}
        why = match_layout(args, layout, expected)
        if why is not None:
            return None, why
        slots = tuple((i - 4, role) for i, role in enumerate(layout) if role in _STEP_ROLES)
        tail = list(args[4:])
        for i, _ in slots:
            tail[i] = None  # the learning call's step tensors: bound per step, never kept
        return Template(fn, tuple(tail), slots), None

    @staticmethod
    def bind(template: Template, step_tensors: dict) -> tuple:
        """The tail of ``template`` with this step's metadata tensors in their slots."""
        tail = list(template.tail)
        for i, role in template.slots:
            tail[i] = step_tensors[role]
        return tuple(tail)

    # -- public op -----------------------------------------------------------------------------

    def varlen_attention(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                         max_seqlen_k, softmax_scale, causal, window_left, softcap, alibi_slopes=None, k_scale=None,
                         v_scale=None) -> None:
        """The public op through FA4's public ``flash_attn_varlen_func`` (correctness over speed).
        ALiBi and fp8 K/V never reach it (``unsupported_reason``)."""
        paged = block_table is not None
        res = self.fa.flash_attn_varlen_func(
            q.detach(), k.detach(), v.detach(), cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=None if paged else cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, page_table=block_table,
            softmax_scale=softmax_scale, causal=causal,
            window_size=(None if window_left < 0 else window_left, None), softcap=softcap)
        out.copy_(res[0] if isinstance(res, tuple) else res)
