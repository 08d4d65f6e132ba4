"""CompileConfig: every knob of the compileattn torch.compile backend, in one place.

Fields marked ``_compiled`` change what the piece compiler produces and are hashed into the
compile-cache key (``compilation/cache.py``); the others (kernel choice, CUDA-graph mode and
sizes, where caches and dumps go) are read at run time only, so changing them keeps a warm cache.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterable, Literal, Sequence

import torch

from .argtypes import non_negative_int, positive_int
from .backends.selector import check_backend_name

PieceCompiler = Literal["inductor", "aot_eager", "eager"]
CudaGraphMode = Literal["auto", "none", "piecewise", "full_and_piecewise"]

DEFAULT_SPLITTING_OPS = ("compileattn::attention", "compileattn::attend")
#: compile_sizes="auto": static compiles for the capture sizes up to this many tokens (decode batches).
AUTO_COMPILE_SIZES_MAX = 8
#: Keyword arguments of Inductor's ``compile_fx`` that are not config settings: ``inductor_options``
#: is applied as config patches, where these names would fail deep inside Inductor.
COMPILE_FX_ARGUMENTS = frozenset({"config_patches", "decompositions", "inner_compile", "ignore_shape_env",
                                  "compile_region_name"})


def _compiled(default=dataclasses.MISSING, **kw):
    """A field that changes the compiled pieces (hashed into the compile-cache key)."""
    return dataclasses.field(default=default, metadata={"compiled": True}, **kw)


def _positive_ints(name: str, values: Any) -> list[int]:
    """``values`` as a list of ints >= 1 (numpy's integers too); a list of anything else, a string,
    or a lone int is refused naming ``name``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a list of positive ints, got {values!r}")
    return [positive_int(v, f"{name}[{i}]") for i, v in enumerate(values)]


def _op_names(name: str, values: Any) -> tuple[str, ...]:
    """Registered op names, "ns::op" or "ns::op.overload"; a string (not a list of them) or a name
    no op answers to is refused naming ``name``: the graph would not be split there, silently."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a list of op names ('ns::op' or 'ns::op.overload'), got {values!r}")
    values = tuple(values)
    for op in values:
        if not isinstance(op, str) or "::" not in op:
            raise ValueError(f"{name}: {op!r} is not an op name ('ns::op' or 'ns::op.overload')")
        namespace, _, rest = op.partition("::")
        packet, _, overload = rest.partition(".")
        try:
            found = getattr(getattr(torch.ops, namespace), packet)
            if overload:
                getattr(found, overload)
        except (AttributeError, RuntimeError):
            raise ValueError(f"{name}: no op is registered as {op!r}") from None
    return values


class _ReadOnlyDict(dict):
    """``CompileConfig.inductor_options``: a dict (what Inductor's config patches, ``json`` and
    ``isinstance`` take) whose entries cannot change after the config's check, as its fields
    cannot (the config is frozen)."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("CompileConfig.inductor_options cannot change after the config is made (it is checked "
                        "then); make a changed copy: dataclasses.replace(cfg, inductor_options={...})")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return type(self), (dict(self),)


def _is_inductor_setting(name: str) -> bool:
    """``name`` (dotted for nested settings: "triton.cudagraphs") is a setting of
    ``torch._inductor.config`` (imported with compileattn already): one of its registered entries,
    which is what its ``patch`` accepts. Any attribute is not enough: the module's methods
    ("patch"), the modules it imports ("os") and a group of settings ("triton") are attributes too,
    and patching them fails inside the first compile."""
    from ._torch_compat import resolve

    return name in resolve("torch._inductor.config")._config


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to ``max_size``: the sizes vLLM settled on, since decode
    batches are small and padding a batch of 9 to 16 wastes less than one more graph costs."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, max_size + 1, 8))
    return sizes


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Settings of ``torch.compile(model, backend="compileattn", options=...)``.

    Pass either a ``CompileConfig`` as ``options={"config": cfg}`` or its fields directly as
    ``options={...}``; unknown keys raise ``TypeError`` so a typo never silently does nothing.

    Frozen, because its values are checked once, when it is made: a value set afterwards would
    reach the compile unchecked. ``dataclasses.replace(cfg, ...)`` makes a changed copy, checked
    again; the lists it is given are kept as tuples, and ``inductor_options`` as a read-only dict
    of its own.
    """

    #: "auto" | "flash" | "triton" | "reference": the attention kernels (chosen per layer by backends/selector.py).
    #: The attention op runs the backend its step's metadata was planned for, so this is read
    #: where metadata is built: ``Engine(model, compile_config=cfg)`` builds with it (and pads steps to
    #: ``cfg.padded_num_tokens``); with a hand-made builder pass ``backend=cfg.attention_backend``.
    attention_backend: str = "auto"
    #: Ops the graph is split at. Names "ns::op" or "ns::op.overload".
    splitting_ops: Sequence[str] = _compiled(DEFAULT_SPLITTING_OPS)
    #: What compiles each piece. "eager"/"aot_eager" are for debugging the split itself.
    piece_compiler: PieceCompiler = _compiled("inductor")
    #: Token counts each piece is also compiled for with static shapes (Inductor only), used when a
    #: step has exactly that many tokens; the dynamic-shape compile serves every other count.
    #: "auto" (``resolved_compile_sizes``): the capture sizes up to ``AUTO_COMPILE_SIZES_MAX`` when
    #: pieces are compiled by Inductor for CUDA graphs on a GPU, none otherwise.
    compile_sizes: Sequence[int] | Literal["auto"] = _compiled("auto")
    #: Worker processes for the piece compiles (``compilation/compile_pool.py``): the static-shape
    #: ones, and the dynamic-shape ones the compiling process has not started itself, in parallel
    #: with each other and with the compiling process, giving back the same artifacts. Started
    #: only where there are static sizes (``compile_sizes``). "auto": two less than the usable
    #: CPUs, at most 8, none under 4 CPUs; 0: every compile in-process, one after another. Two or
    #: more are forked from one process that imported torch once (``compilation/fork_server.py``).
    #: A worker lives until its compiles are done (past the compile, with
    #: ``background_static_compiles``) and takes ~1 GB of host memory; compiling for CUDA it may
    #: also open a CUDA context on the GPU (not measured).
    compile_workers: int | Literal["auto"] = "auto"
    #: When the workers start. "first_call": before Dynamo traces, so their import overlaps the
    #: trace, and they take dynamic-shape compiles as well as static ones. "decoration": as
    #: "first_call", with the fork server they are forked from (a pool of two or more) started by
    #: ``@compileattn.compile`` itself, so that its imports overlap the model's build and weight
    #: loading (not where a warm start file of the function is in ``cache_dir``: that first call
    #: likely loads). "auto": "decoration" where the server can be a fork of this process then
    #: (one Python thread, CUDA untouched: ``fork_server.why_not_fork_here``), ready one Inductor
    #: import later; "first_call" otherwise. A fresh interpreter started at decoration did not help
    #: on the H200's host (run S13-1, decoration / first call: OPT-125m shape 10.12 / 9.30 s,
    #: Llama-3-8B shape 18.96 / 19.37 s): its import of torch took 11.8-15.2 s beside the build and
    #: the trace. "after_dynamic": once
    #: the compiling process has compiled every dynamic-shape piece itself, so nothing competes
    #: with it, at the price of static pieces landing later. Two runs on the H200's 16-CPU host
    #: with fresh-interpreter workers, before dynamic-shape compiles went to them (first call,
    #: after_dynamic against first_call, s): S9-2 OPT-125m shape 8.46 / 11.02, Llama-3-8B shape
    #: 16.67 / 16.66; S9-6 OPT 7.58 / 10.51, Llama 16.11 / 15.80.
    compile_workers_start: Literal["auto", "first_call", "decoration", "after_dynamic"] = "auto"
    #: With workers, return from the compile once the dynamic-shape pieces are ready and let the
    #: static-shape ones land when the workers finish them (``compilation/landing.py``): until a
    #: size's static pieces land, its steps run the dynamic-shape pieces (correct, slower), and its
    #: CUDA graphs are captured again once they do. On the H200 a worker was ready only 11.9-15.6 s
    #: after it started (a fresh interpreter importing torch), and waiting for them made the OPT-125m
    #: shape's cold start 20.4 s against 7.6 s with dynamic shapes only (benchmarks/results/coldwarm_S7-1.md).
    #: False waits for every static piece (what a server that captures its graphs once at start-up
    #: wants: ``compileattn.LLM`` does). Pieces holding collectives (tensor parallelism) always wait:
    #: every rank must capture their graphs at the same step.
    background_static_compiles: bool = True
    #: "auto" = "full_and_piecewise" on CUDA, "none" elsewhere.
    cudagraph_mode: CudaGraphMode = "auto"
    #: Token counts captured as CUDA graphs; None = default_capture_sizes(max_capture_size).
    cudagraph_capture_sizes: Sequence[int] | None = None
    max_capture_size: int = 256
    #: ``@compileattn.compile``: Dynamo traces one decoder layer and reuses it for the others (they
    #: are nested compile regions during the trace, flattened before the split, so the compiled
    #: pieces are the same: ``compilation/regions.py``). False traces every layer (the flat trace).
    trace_layers_once: bool = True
    #: Split each unified attention op into a K/V write, captured in the piece before it, and the
    #: attention itself, run eagerly (passes/kv_write.py).
    capture_kv_write: bool = _compiled(True)
    #: Move shape logic that feeds an attention op into the neighbouring piece (passes/hoist.py).
    hoist_shape_logic: bool = _compiled(True)
    #: Extra Inductor settings for every piece (``torch._inductor.config`` names, e.g.
    #: ``{"max_autotune": True}``), applied as that compile's config patches.
    inductor_options: dict[str, Any] = _compiled(default_factory=dict)
    #: Where compiled pieces are saved and loaded; None disables the compile cache.
    cache_dir: str | None = None
    #: Where depyf writes decompiled code, graphs and pieces; None disables the dump.
    debug_dump_dir: str | None = None
    #: Run @compileattn.compile functions eagerly (also COMPILEATTN_DISABLE=1), for bisecting.
    disable: bool = False
    #: Verify on the first replay of every size that piece inputs live where they were captured.
    #: (A parameter replaced after capture is caught either way: compilation/module_watch.py.)
    check_input_addresses: bool = True
    #: ``@compileattn.compile``'s first call (``torch.compile``'s: the backend, once Dynamo has
    #: traced) compiles the Triton attention kernels its first step will launch in other processes
    #: while the model compiles (``compilation/kernel_warmup.py``); False leaves them to their
    #: first launch in the first run.
    compile_kernels_ahead: bool = True
    #: ``@compileattn.compile`` replays a full-decode graph itself, skipping Dynamo's code, where
    #: that provably returns the same (compilation/replay.py); False always runs Dynamo's code.
    direct_full_replay: bool = True

    def __post_init__(self) -> None:
        # Types first: a string is iterable (splitting_ops="ns::op" was split into characters and
        # split nothing), a float int()-ed quietly, and any truthy object passed for a bool.
        for f in dataclasses.fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"{f.name} must be a bool, got {getattr(self, f.name)!r}")
        object.__setattr__(self, "max_capture_size", positive_int(self.max_capture_size, "max_capture_size"))
        if not isinstance(self.inductor_options, dict) or not all(isinstance(k, str) for k in self.inductor_options):
            raise TypeError(f"inductor_options must be a dict of torch._inductor.config names, got "
                            f"{self.inductor_options!r}")
        # Not the caller's dict, and read-only: a setting added afterwards would escape the check.
        object.__setattr__(self, "inductor_options", _ReadOnlyDict(self.inductor_options))
        for name in ("cache_dir", "debug_dump_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {value!r}")
        object.__setattr__(self, "splitting_ops", _op_names("splitting_ops", self.splitting_ops))
        check_backend_name(self.attention_backend)
        if self.piece_compiler not in ("inductor", "aot_eager", "eager"):
            raise ValueError(f"piece_compiler must be inductor, aot_eager or eager, got {self.piece_compiler!r}")
        if self.cudagraph_mode not in ("auto", "none", "piecewise", "full_and_piecewise"):
            raise ValueError(f"cudagraph_mode: unknown mode {self.cudagraph_mode!r}")
        if self.cudagraph_capture_sizes is not None:
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(_positive_ints(
                "cudagraph_capture_sizes", self.cudagraph_capture_sizes)))))
            if not self.cudagraph_capture_sizes:
                raise ValueError("cudagraph_capture_sizes must hold at least one size (None: the default sizes)")
        if self.compile_workers_start not in ("auto", "first_call", "decoration", "after_dynamic"):
            raise ValueError(f"compile_workers_start must be 'auto', 'first_call', 'decoration' or 'after_dynamic', "
                             f"got {self.compile_workers_start!r}")
        if isinstance(self.compile_workers, str):
            if self.compile_workers != "auto":
                raise ValueError(f"compile_workers must be 'auto' or an int >= 0, got {self.compile_workers!r}")
        else:  # an int as argtypes counts them (numpy's too); a bool or a float is no count of workers
            object.__setattr__(self, "compile_workers", non_negative_int(self.compile_workers, "compile_workers"))
        misplaced = sorted(set(self.inductor_options) & COMPILE_FX_ARGUMENTS)
        if misplaced:
            raise ValueError(f"inductor_options holds Inductor config settings (torch._inductor.config names), "
                             f"applied as one compile's config patches; {misplaced} are compile_fx arguments, "
                             f"not settings: give their contents (e.g. {{'max_autotune': True}})")
        unknown = [k for k in self.inductor_options if not _is_inductor_setting(k)]
        if unknown:  # else the first compile fails inside Inductor's config patch
            raise ValueError(f"inductor_options: {unknown} are not torch._inductor.config settings")
        if isinstance(self.compile_sizes, str):
            if self.compile_sizes != "auto":
                raise ValueError(f"compile_sizes must be 'auto' or a list of positive ints, got {self.compile_sizes!r}")
        else:
            object.__setattr__(self, "compile_sizes", tuple(sorted(set(_positive_ints("compile_sizes",
                                                                                      self.compile_sizes)))))

    @property
    def capture_sizes(self) -> list[int]:
        if self.cudagraph_capture_sizes is not None:
            return list(self.cudagraph_capture_sizes)
        return default_capture_sizes(self.max_capture_size)

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The capture size a step of ``num_tokens`` is padded to (itself if above every size)."""
        for size in self.capture_sizes:
            if size >= num_tokens:
                return size
        return num_tokens

    def resolved_compile_sizes(self, device_type: str) -> tuple[int, ...]:
        """The static compile sizes for pieces on ``device_type``. "auto" picks the decode sizes
        that pay: static kernels took compileattn's full-decode step on the OPT-125m shape from
        1.14x to 1.03x of the best hand-captured graph at batch 1 and from 1.04x to 1.02x at batch 8
        (H200, ``benchmarks/results/latency_opt_static.md``), but each size is one more compile per
        distinct piece at cold start, so only sizes up to ``AUTO_COMPILE_SIZES_MAX``, and only
        where they are replayed from CUDA graphs (not on the CPU, where compiles are slow)."""
        if not isinstance(self.compile_sizes, str):
            return tuple(self.compile_sizes)
        if device_type != "cuda" or self.piece_compiler != "inductor" or self.resolved_cudagraph_mode("cuda") == "none":
            return ()
        return tuple(s for s in self.capture_sizes if s <= AUTO_COMPILE_SIZES_MAX)

    def resolved_cudagraph_mode(self, device_type: str) -> str:
        if self.cudagraph_mode != "auto":
            return self.cudagraph_mode
        return "full_and_piecewise" if device_type == "cuda" else "none"

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> "CompileConfig":
        options = dict(options or {})
        config = options.pop("config", None)
        if config is not None and not isinstance(config, CompileConfig):
            raise TypeError(f"options['config'] must be a CompileConfig, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown compileattn option(s) {unknown}; known: {sorted(names)}")
        if config is None:
            return cls(**options)
        return dataclasses.replace(config, **options)

    def hash(self) -> str:
        """Stable hash of the fields that change the compiled pieces (``_compiled``)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("compiled")}
        blob = json.dumps(fields, sort_keys=True, default=repr)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
