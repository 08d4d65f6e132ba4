#!/usr/bin/env python
"""End-to-end step latency: eager, torch.compile, compileattn, and hand-captured full CUDA graphs.

Models (random weights, issue 5 item 3): an OPT-125m-shaped decoder in fp16 and a
Llama-3-8B-shaped decoder in bf16 (GQA 32/8). Steps: decode steps of ``batch`` sequences that
each already have ``context`` tokens in the paged KV cache (filled with random K/V directly, no
prefill through the model), and one mixed step (decodes + one prefill chunk).

A step is ``model(input_ids, positions)`` inside the step's forward context, timed as wall time
from the call to the end of a ``torch.cuda.synchronize()`` (CPU work included), per step; the
tables give p50/p90/p99 over ``--steps`` steps after ``--warmup``. The per-step metadata is built
once per cell, outside the timed region, and is the same object for every column (building it is
host work every column would pay alike; ``benchmarks/op_overhead.py`` measures per-call costs).

Columns, all running the same attention backend (``--backend``, default ``triton``: capturable):

- ``eager``: the model as written (the attention op through the dispatcher);
- ``inductor``: ``torch.compile(model, fullgraph=True)``, token dim marked dynamic;
- ``reduce-overhead``: the same with ``mode="reduce-overhead"`` (Inductor's CUDA-graph trees);
- ``ca-piecewise``: ``compileattn.compile`` with ``CompileConfig(cudagraph_mode="piecewise")``;
- ``ca-full``: the same with ``cudagraph_mode="full_and_piecewise"`` (full graphs for decode);
- ``graph-eager`` / ``graph-inductor``: one hand-captured ``torch.cuda.graph`` of the whole eager /
  Inductor-compiled step per token count, replayed (the floors: no CPU work between kernels).

Inputs live in persistent buffers (each step passes views ``[:num_tokens]`` of one tensor), token
counts are padded with ``CompileConfig.padded_num_tokens``, and every column reads and writes the
same caches through the same metadata buffers, so CUDA-graph addresses stay valid across cells.
Every column's output is compared with eager's for the same step before it is timed; one that
disagrees is reported FAILED, not timed.

Also measured: compile time of each compiled column (its first call), capture time and graph-pool
memory of the compileattn runtimes and the hand-captured graphs, and compileattn's cold and warm
start in fresh subprocesses after a model's columns (``coldwarm.py``'s cold and warm phases: cold:
empty compileattn, Inductor and Triton cache dirs; warm: a second process on the same dirs, which
loads the compile without Dynamo; ``--cold-warm-only`` runs just these).

Also recorded, for the roofline column of the report (``latency_report.py``): the device-to-device
copy bandwidth, measured once per run, and per model the bytes a step must read (the decoder
stack's weights, and the K/V bytes per attended token).

Measuring is this module; merging runs, ratios, goal checks, the roofline, markdown and the plot
are ``latency_report.py`` (``--merge`` goes straight there, no GPU needed).

The goals' ratios (a compileattn column ÷ the faster hand-captured full graph) are measured side by
side: after a compileattn column's own timed steps, ``--steps`` rounds each run one step of the
column and one replay of each full graph of the same cell, in rotating order, every step ended by
a synchronize (``interleaved_steps``), and the row records the p50 of each (``paired``). Timed
alone, the columns are minutes apart, and on a 0.4-0.9 ms OPT step the host's and GPU's drift
between them (a few per cent) was larger than the 2 % goal; interleaved, both sides see the same
drift. So the full graphs are captured first and kept until the compileattn columns are done.

Under ``--budget-s`` the column groups run in priority order (eager and its full graph, Inductor
and its full graph, compileattn piecewise, compileattn full-decode, reduce-overhead), then the
cold/warm subprocesses; whatever is past the budget is reported as skipped.

Run: see benchmarks/README.md. On a machine without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common  # noqa: E402
import latency_report as report  # noqa: E402
from latency_report import COLUMNS, MODELS  # noqa: E402

BLOCK_SIZE = 16
#: Where everything runs. Only "cuda" is a benchmark; "cpu" exists so the plumbing can be smoke-run
#: on a machine without a GPU (by a test or a developer setting this attribute).
DEVICE = "cuda"
#: Norm-relative difference to eager allowed, per dtype: fused kernels round differently, and the
#: difference grows over the layers of a random-weight model. Measured on the H200: torch.compile's
#: own Inductor output is 5.4-6.6 % away from eager on the 32-layer Llama shape in bf16 (whose
#: 8-bit mantissa is 8x coarser than fp16's), and < 1 % on the OPT shape in fp16. A wrong attention
#: (stale cache, padding leaking into real tokens) is off by O(1), far above either.
TOLERANCE = {"float16": 5e-2, "bfloat16": 1e-1, "float32": 1e-3}

#: Columns measured together (they share a compiled object); order = priority under the budget.
#: The full graphs first: the compileattn columns are timed interleaved with them (module
#: docstring), so they must exist when those run. reduce-overhead last: the floors are released
#: before it (its own CUDA-graph trees need the memory more than it needs a pairing).
GROUPS = [
    ("eager", ("eager", "graph-eager")),
    ("inductor", ("inductor", "graph-inductor")),
    ("ca-piecewise", ("ca-piecewise",)),
    ("ca-full", ("ca-full",)),
    ("reduce-overhead", ("reduce-overhead",)),
]
#: The groups whose full graphs (``report.FULL_GRAPHS``) the compileattn columns are paired with,
#: and the columns paired: kept from the end of their own group until every paired column ran.
FLOOR_GROUPS = ("eager", "inductor")
PAIRED_COLUMNS = ("ca-piecewise", "ca-full")
#: Budget seconds a compiled column group needs left to be started at all.
GROUP_RESERVE_S = 45.0

DEFAULTS = {"models": ["opt", "llama"], "batches": [1, 8, 64], "contexts": [512, 4096], "steps": 50, "warmup": 5}
QUICK = {"models": ["opt"], "batches": [1, 8], "contexts": [512], "steps": 20, "warmup": 4}
DEFAULT_OUT = common.RESULTS_DIR / "latency"


class Unavailable(Exception):
    """This column cannot run in this configuration (the message says why)."""


# ----------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ints = common.argparse_type(common.parse_int_list)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=common.argparse_type(lambda s: common.parse_name_list(s, list(MODELS))),
                   default=None, help="opt,llama (default both; --quick: opt)")
    p.add_argument("--batches", type=ints, default=None, help="decode batch sizes (default 1,8,64)")
    p.add_argument("--contexts", type=ints, default=None, help="tokens already cached per sequence (default 512,4096)")
    p.add_argument("--columns", type=common.argparse_type(lambda s: common.parse_name_list(s, COLUMNS)),
                   default=list(COLUMNS), help=f"subset of {','.join(COLUMNS)}")
    p.add_argument("--steps", type=int, default=None, help="timed steps per cell (default 50, quick 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per cell first (default 5, quick 4)")
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed prefill+decode step")
    p.add_argument("--mixed-decodes", type=int, default=8, help="decodes in the mixed step (at the first context)")
    p.add_argument("--mixed-prefill", type=int, default=248, help="prefill tokens in the mixed step")
    p.add_argument("--backend", default="triton", help="attention backend of every column (default triton)")
    p.add_argument("--compile-sizes", default="auto",
                   help="token counts the compileattn columns also compile with static shapes "
                        "(CompileConfig.compile_sizes): 'auto' (the default: the decode capture sizes up to 8), "
                        "'' for none, or a comma-separated list")
    p.add_argument("--llama-layers", type=int, default=None, help="override the Llama shape's 32 layers")
    p.add_argument("--inductor-options", type=common.argparse_type(common.json_object), default={}, metavar="JSON",
                   help="CompileConfig.inductor_options of the compileattn columns, e.g. "
                        "'{\"post_grad_custom_post_pass\": null}' (the pieces' residual-add pass off)")
    p.add_argument("--no-cold-warm", action="store_true", help="skip the cold/warm compile subprocesses")
    p.add_argument("--cold-warm-only", action="store_true", help="only the cold/warm compile subprocesses")
    p.add_argument("--quick", action="store_true",
                   help="OPT only, batch 1 and 8, context 512, 20 steps, no cold/warm subprocesses")
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="wall-clock budget; work past it is reported as skipped (0 = none)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="norm-relative error to eager allowed (default per dtype: fp16 0.05, bf16 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output prefix: writes PREFIX.json/.md/.png")
    p.add_argument("--label", default=None)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="merge result files of several runs into one report (no GPU needed)")
    p.add_argument("-o", "--output", default=None, help="output prefix for --merge (default: --out)")
    p.add_argument("--baseline", default=None, metavar="JSON",
                   help="an earlier result file: the report adds each row's p50 change against it")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    if args.cold_warm_only and args.no_cold_warm:
        p.error("--cold-warm-only and --no-cold-warm exclude each other")
    if args.quick and not args.cold_warm_only:
        args.no_cold_warm = True
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.mixed_decodes < 0 or args.mixed_prefill < 1:
        p.error("--mixed-decodes must be >= 0 and --mixed-prefill >= 1")
    if args.llama_layers is not None and args.llama_layers < 1:
        p.error("--llama-layers must be >= 1")
    return args


# ----------------------------------------------------------------------------------------------
# Cells: the steps measured


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str  # "decode" | "mixed"
    batch: int  # decode sequences
    context: int  # tokens cached per decode sequence
    prefill: int = 0  # new tokens of the one prefill sequence (mixed only)

    @property
    def tokens(self) -> int:
        return self.batch + self.prefill

    @property
    def name(self) -> str:
        if self.kind == "mixed":
            return f"mixed: {self.batch} decodes @ {self.context} + prefill {self.prefill}"
        return f"decode b{self.batch} @ {self.context}"

    def seqs(self, block_size: int = BLOCK_SIZE, first_block: int = 0):
        """SequenceStep list (decodes first, as the builder wants), blocks assigned consecutively
        from ``first_block``."""
        from compileattn.metadata import SequenceStep

        out, nxt = [], first_block
        per = -(-(self.context + 1) // block_size)
        for _ in range(self.batch):
            out.append(SequenceStep(1, self.context, list(range(nxt, nxt + per))))
            nxt += per
        if self.prefill:
            n = -(-self.prefill // block_size)
            out.append(SequenceStep(self.prefill, 0, list(range(nxt, nxt + n))))
            nxt += n
        return out

    def blocks(self, block_size: int = BLOCK_SIZE) -> int:
        return sum(len(s.block_table) for s in self.seqs(block_size))

    def max_blocks_per_seq(self, block_size: int = BLOCK_SIZE) -> int:
        return max(len(s.block_table) for s in self.seqs(block_size))

    def positions(self) -> list[int]:
        return [self.context] * self.batch + list(range(self.prefill))


def make_cells(args) -> list[Cell]:
    """Largest token count first: every compiled column's first call (its compile) then has >= 2
    tokens, which a dynamic token dim needs (Dynamo specializes sizes 0 and 1)."""
    cells = [Cell("decode", b, c) for c in args.contexts for b in args.batches]
    if not args.no_mixed:
        cells.append(Cell("mixed", args.mixed_decodes, args.contexts[0], args.mixed_prefill))
    return sorted(cells, key=lambda c: (-c.tokens, c.context))


# ----------------------------------------------------------------------------------------------
# Models and the shared state of one model's run


def build_model(name: str, *, max_position: int, layers: int | None, device: str | None = None):
    import torch

    device = device or DEVICE
    if name == "opt":
        from compileattn.models.opt import OPTConfig, OPTForCausalLM

        # OPT-125m's table has 2048 positions; the 4096-token cells need more rows (shape only).
        cfg = OPTConfig.opt_125m(max_position=max(2048, max_position))
        return OPTForCausalLM(cfg, dtype=torch.float16, device=device, seed=0)
    if name == "llama":
        from compileattn.models.llama import LlamaConfig, LlamaForCausalLM

        over = {"max_position": max(8192, max_position)}
        if layers is not None:
            over["num_layers"] = layers
        return LlamaForCausalLM(LlamaConfig.llama3_8b(**over), dtype=torch.bfloat16, device=device, seed=0)
    raise ValueError(f"unknown model {name!r}")


def step_byte_counts(model, caches) -> dict[str, int]:
    """The bytes a step of ``model`` must read, for the roofline (``latency_report.step_bytes``):
    the decoder stack's parameters (``model.model``: ``forward`` returns hidden states, so the LM
    head never runs; embedding tables are gathered a row per token, not read, and left out), and
    the K/V bytes of one attended token over every layer's cache."""
    import torch.nn as nn

    body = getattr(model, "model", model)
    gathered = {id(m.weight) for m in body.modules() if isinstance(m, nn.Embedding)}
    weights = sum(p.numel() * p.element_size() for p in body.parameters() if id(p) not in gathered)
    kv = sum(2 * c.spec.num_kv_heads * c.spec.head_dim * c.key_cache.element_size() for c in caches.values())
    return {"weight_bytes": int(weights), "kv_bytes_per_token": int(kv), "layers": len(caches)}


class Bench:
    """One model's model, caches, metadata builder and persistent input buffers."""

    def __init__(self, name: str, cells: Sequence[Cell], args, log: common.Log, model=None):
        """``model``: a model built elsewhere (latency_tp.py's sharded ones); default ``build_model``."""
        import torch

        import compileattn as ca

        self.name = name
        self.args = args
        self.log = log
        self.cells = list(cells)
        max_pos = max(c.context + max(1, c.prefill) for c in cells) + 8
        t = time.monotonic()
        self.model = model if model is not None else build_model(
            name, max_position=max_pos, layers=args.llama_layers if name == "llama" else None)
        self.dtype = next(self.model.parameters()).dtype
        self.pad_config = ca.CompileConfig(max_capture_size=max(256, max(c.tokens for c in cells)))
        self.max_tokens = max(self.pad_config.padded_num_tokens(c.tokens) for c in cells)
        # Every cell owns its blocks: a step writes its tokens' K/V into the cache, and with shared
        # blocks one cell's writes would change the context another cell reads, so a column's output
        # would depend on which cells ran before it and could not be compared with eager's.
        self.first_block: dict[Cell, int] = {}
        num_blocks = 1
        for c in cells:
            self.first_block[c] = num_blocks
            num_blocks += c.blocks()
        self.caches = ca.allocate_kv_caches(self.model.attention_specs(), num_blocks, BLOCK_SIZE, dtype=self.dtype,
                                            device=DEVICE)
        gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
        for cache in self.caches.values():  # the "context already in the cache": random K/V
            cache.key_cache.normal_(generator=gen)
            cache.value_cache.normal_(generator=gen)
        self.builder = ca.AttentionMetadataBuilder(
            block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_tokens=self.max_tokens,
            max_blocks_per_seq=max(c.max_blocks_per_seq() for c in cells), device=DEVICE, backend=args.backend)
        self.ids_buf = torch.zeros(self.max_tokens, dtype=torch.long, device=DEVICE)
        self.pos_buf = torch.zeros(self.max_tokens, dtype=torch.long, device=DEVICE)
        self.reference: dict[Cell, Any] = {}
        self.byte_counts = step_byte_counts(self.model, self.caches)
        cache_gib = sum(c.key_cache.numel() * 2 * c.key_cache.element_size() for c in self.caches.values()) / 2**30
        log(f"{name}: model + {cache_gib:.1f} GiB KV cache ({num_blocks} blocks of {BLOCK_SIZE}) ready in "
            f"{time.monotonic() - t:.1f} s")

    def padded(self, cell: Cell) -> int:
        return self.pad_config.padded_num_tokens(cell.tokens)

    def prepare(self, cell: Cell):
        """Write the cell's inputs into the persistent buffers and build its metadata (which writes
        the builder's persistent metadata buffers); returns (metadata, ids view, positions view)."""
        import torch

        n = self.padded(cell)
        md = self.builder.build(cell.seqs(first_block=self.first_block[cell]), pad_to=n)
        gen = torch.Generator(device=DEVICE).manual_seed(self.args.seed * 7 + cell.tokens * 13 + cell.context)
        self.ids_buf.zero_()
        self.pos_buf.zero_()
        vocab = self.model.config.vocab_size
        self.ids_buf[: cell.tokens].copy_(torch.randint(0, vocab, (cell.tokens,), generator=gen, device=DEVICE))
        self.pos_buf[: cell.tokens].copy_(torch.tensor(cell.positions(), dtype=torch.long))
        return md, self.ids_buf[:n], self.pos_buf[:n]

    def close(self) -> None:
        del self.model, self.caches, self.builder, self.ids_buf, self.pos_buf
        self.reference.clear()


# ----------------------------------------------------------------------------------------------
# Column groups: how each column's step is made


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _mark_dynamic(*tensors) -> None:
    import torch

    for t in tensors:
        if t.shape[0] >= 2:  # a size-1 dim cannot be dynamic (Dynamo specializes 0 and 1)
            torch._dynamo.mark_dynamic(t, 0)


class _HandGraphs:
    """One ``torch.cuda.graph`` of a whole step per token count (compileattn's GraphPool: warm-up
    call, capture into one pool), the floor a runtime with no CPU work could reach."""

    def __init__(self, fn: Callable, name: str):
        import torch

        from compileattn.compilation.cudagraph import make_pool

        self.fn = fn
        self.name = name
        # make_pool: a GraphPool, or under compileattn.testing.simulated_cuda_graphs (the CPU test of
        # this module's real groups) a simulated one
        self.pool = make_pool(torch.device(DEVICE))
        self.graphs: dict[int, Any] = {}

    def graph(self, num_tokens: int):
        entry = self.graphs.get(num_tokens)
        return entry.graph if entry is not None else None

    def step(self, ids, pos) -> Callable[[], Any]:
        n = ids.shape[0]

        def run():
            entry = self.graphs.get(n)
            if entry is None:
                entry = self.graphs[n] = self.pool.capture(self.fn, (ids, pos), self.name, n)
                return entry.outputs
            if not entry.checked:
                entry.check((ids, pos))
            entry.graph.replay()
            return entry.outputs

        return run

    def replay_step(self, ids, pos) -> Callable[[], Any] | None:
        """A step that only replays the graph already captured for ``ids``' token count (None if
        there is none): nothing of the compile path (``_mark_dynamic``, capture) runs again."""
        entry = self.graphs.get(ids.shape[0])
        if entry is None:
            return None

        def run():
            entry.graph.replay()
            return entry.outputs

        return run

    def stats(self) -> dict[str, Any]:
        return {"capture_s": self.pool.capture_seconds, "graph_pool_bytes": self.pool.pool_bytes(),
                "graphs": len(self.graphs)}


class Group:
    columns: tuple[str, ...] = ()

    def step(self, column: str, cell: Cell, ids, pos) -> Callable[[], Any]:
        raise NotImplementedError

    def stats(self, column: str) -> dict[str, Any]:
        return {}

    def captured_graph(self, column: str, num_tokens: int):
        """The CUDA graph of a whole step of ``num_tokens`` this column replays, if it has one."""
        return None

    def floor_step(self, column: str, ids, pos) -> Callable[[], Any] | None:
        """For a full-graph column (``FLOOR_GROUPS``): a step replaying its graph captured for
        ``ids``' token count, None if there is none."""
        return None


def decode_backends(bench: Bench) -> list:
    """The backends the selector runs a decode step's layers on (after fallback)."""
    sel = bench.builder.selector
    return [sel.backend_for(c.spec, c.dtype, BLOCK_SIZE, uniform_decode=True) for c in bench.caches.values()]


def _require_capturable(bench: Bench, what: str) -> None:
    for backend in decode_backends(bench):
        if not backend.capturable:
            raise Unavailable(f"{what} needs a CUDA-graph-capturable attention backend; {backend.name!r} is not")


class _FullGraphGroup(Group):
    """A group whose ``graph_column`` replays hand-captured full graphs (``_HandGraphs``) of its
    other column's step: their stats, graphs and replays as a floor (``FLOOR_GROUPS``)."""

    graph_column = ""

    def __init__(self, bench: Bench):
        self.bench = bench
        self.graphs: _HandGraphs | None = None

    def _graphs_of(self, column: str) -> _HandGraphs | None:
        return self.graphs if column == self.graph_column else None

    def stats(self, column):
        graphs = self._graphs_of(column)
        return graphs.stats() if graphs else {}

    def captured_graph(self, column, num_tokens):
        graphs = self._graphs_of(column)
        return graphs.graph(num_tokens) if graphs else None

    def floor_step(self, column, ids, pos):
        graphs = self._graphs_of(column)
        return graphs.replay_step(ids, pos) if graphs else None


class EagerGroup(_FullGraphGroup):
    columns = ("eager", "graph-eager")
    graph_column = "graph-eager"

    def step(self, column, cell, ids, pos):
        model = self.bench.model
        if column == "eager":
            return lambda: model(ids, pos)
        _require_capturable(self.bench, "a full CUDA graph of the eager step")
        if self.graphs is None:
            self.graphs = _HandGraphs(model, "eager full graph")
        return self.graphs.step(ids, pos)


class InductorGroup(_FullGraphGroup):
    columns = ("inductor", "graph-inductor")
    graph_column = "graph-inductor"

    def __init__(self, bench: Bench):
        import torch

        super().__init__(bench)
        #: every function Inductor compiled for this group: the captured full graphs launch their
        #: kernels, and Triton unloads a kernel's module when its compiled function is collected,
        #: which ``torch._dynamo.reset`` (between the later groups) would otherwise let happen
        #: while this group's graphs are still replayed as the floor.
        self.kept: list[Callable] = []
        self.compiled = torch.compile(bench.model, fullgraph=True, backend=_inductor_keeping(self.kept))

    def step(self, column, cell, ids, pos):
        _mark_dynamic(ids, pos)
        compiled = self.compiled
        if column == "inductor":
            return lambda: compiled(ids, pos)
        _require_capturable(self.bench, "a full CUDA graph of the Inductor step")
        if self.graphs is None:
            self.graphs = _HandGraphs(compiled, "inductor full graph")
        return self.graphs.step(ids, pos)


def _inductor_keeping(kept: list) -> Callable:
    """``torch.compile``'s default backend (Inductor's ``compile_fx``, no options), appending what
    it compiles to ``kept``."""
    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs)
        kept.append(compiled)
        return compiled

    return backend


class ReduceOverheadGroup(Group):
    columns = ("reduce-overhead",)

    def __init__(self, bench: Bench):
        import torch

        self.compiled = torch.compile(bench.model, mode="reduce-overhead", fullgraph=True)

    def step(self, column, cell, ids, pos):
        import torch

        _mark_dynamic(ids, pos)
        compiled = self.compiled
        mark = torch.compiler.cudagraph_mark_step_begin

        def run():
            mark()  # each call is a new step: earlier outputs may be overwritten (we clone before)
            return compiled(ids, pos)

        return run


def make_forward(model):
    def forward(input_ids, positions):
        return model(input_ids, positions)

    return forward


class CompileattnGroup(Group):
    def __init__(self, bench: Bench, column: str):
        import compileattn as ca
        from compileattn.testing import RecordingBackend

        self.columns = (column,)
        mode = {"ca-piecewise": "piecewise", "ca-full": "full_and_piecewise"}[column]
        if mode == "full_and_piecewise":
            _require_capturable(bench, "compileattn full-decode graphs")
        text = bench.args.compile_sizes.strip()
        sizes = "auto" if text == "auto" else tuple(int(x) for x in text.split(",") if x.strip())
        # piece_compiler: latency_tp.py's CPU smoke run compiles pieces eagerly (seconds, not minutes)
        self.config = ca.CompileConfig(cudagraph_mode=mode, attention_backend=bench.args.backend,
                                       max_capture_size=bench.pad_config.max_capture_size, compile_sizes=sizes,
                                       piece_compiler=getattr(bench.args, "piece_compiler", "inductor"),
                                       inductor_options=getattr(bench.args, "inductor_options", {}),
                                       background_static_compiles=False)  # time the static pieces, not the wait
        self.runtimes = RecordingBackend(config=self.config)
        self.fn = ca.compile(make_forward(bench.model), dynamic_arg_dims={"input_ids": 0, "positions": 0},
                             config=self.config, backend=self.runtimes)
        self.compiled = False

    def step(self, column, cell, ids, pos):
        if not self.compiled and ids.shape[0] < 2:
            raise Unavailable("compileattn.compile's first call (the compile) needs >= 2 tokens; "
                              "include a batch >= 2 or the mixed step")
        self.compiled = True
        fn = self.fn
        return lambda: fn(ids, pos)

    def stats(self, column):
        if not self.runtimes.built:
            return {}
        rt = self.runtimes.built[-1]
        return {"capture_s": rt.capture_seconds(),
                "graph_pool_bytes": rt.graph_pool_bytes(), "runtimes": len(self.runtimes.built),
                "full_graphs": rt.full_graph_count(), "piece_graphs": rt.piece_graph_count(), "mode": rt.mode,
                "direct_replay": self.fn.compile_stats.get("direct_replay")}

    def captured_graph(self, column, num_tokens):
        """The full-decode graph the step replayed (none in piecewise mode or for a mixed step)."""
        for rt in reversed(self.runtimes.built):  # Dynamo may build a 1-token runtime of its own
            entry = rt._full.graphs.get(num_tokens) if rt._full is not None else None
            if entry is not None:
                return entry.graph
        return None


def make_group(name: str, bench: Bench) -> Group:
    if name == "eager":
        return EagerGroup(bench)
    if name == "inductor":
        return InductorGroup(bench)
    if name == "reduce-overhead":
        return ReduceOverheadGroup(bench)
    return CompileattnGroup(bench, name)


def _reset_compilers() -> None:
    import torch

    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass
    try:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()
    _sync()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Measuring


def base_row(model: str, cell: Cell, column: str, padded: int) -> dict[str, Any]:
    return {"run": 0, "model": model, "kind": cell.kind, "batch": cell.batch, "context": cell.context,
            "prefill": cell.prefill, "tokens": cell.tokens, "padded_tokens": padded, "column": column,
            "status": None, "reason": ""}


def warm_up(step: Callable[[], Any], warmup: int) -> tuple[float, Any]:
    """Run ``warmup`` (>= 1) untimed steps; (seconds of the first, which compiles/captures when the
    column does that lazily; a clone of the last output, for the comparison with eager)."""
    t = time.perf_counter()
    out = step()
    _sync()
    first = time.perf_counter() - t
    for _ in range(warmup - 1):
        out = step()
    _sync()
    check = out.detach().clone()
    return first, check


def timed_steps(step: Callable[[], Any], steps: int) -> list[float]:
    """Wall seconds per step, each ended by a device synchronize (the step's CPU work included)."""
    _sync()
    samples = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        _sync()
        samples.append(time.perf_counter() - t)
    return samples


def interleaved_steps(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds per step of each of ``steps``, timed side by side: each round runs every step
    once, each ended by a device synchronize, in an order rotated by one per round (no step always
    follows the same one: the step after another inherits its L2 and clock state)."""
    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    _sync()
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t = time.perf_counter()
            steps[name]()
            _sync()
            samples[name].append(time.perf_counter() - t)
    return samples


def paired_timing(step: Callable[[], Any], column: str, floors: dict[str, Group], ids, pos,
                  rounds: int) -> dict[str, Any] | None:
    """``column``'s step interleaved with a replay of each full graph captured for this cell's
    token count (``interleaved_steps``): ``{"rounds", "p50_us": {column or floor column: p50}}``,
    None when no floor has a graph of this size."""
    steps = {column: step}
    for floor_column, group in floors.items():
        floor = group.floor_step(floor_column, ids, pos)
        if floor is not None:
            steps[floor_column] = floor
    if len(steps) < 2:
        return None
    samples = interleaved_steps(steps, rounds)
    return {"rounds": rounds, "p50_us": {name: common.summarize_us(s)["p50_us"] for name, s in samples.items()}}


def replay_gpu_us(graph, replays: int = 20) -> float:
    """GPU µs of one replay of a captured step graph (``cudagraph.replay_gpu_us``); a step's p50
    minus this is its host cost."""
    from compileattn.compilation.cudagraph import replay_gpu_us as replay_us

    return replay_us(graph, replays)


def eager_reference(bench: Bench, cell: Cell) -> Any:
    import torch

    import compileattn as ca

    md, ids, pos = bench.prepare(cell)
    with ca.set_forward_context(md, bench.caches), torch.no_grad():
        bench.model(ids, pos)
        out = bench.model(ids, pos)
        _sync()
    return out[: cell.tokens].detach().clone()


def measure_cell(bench: Bench, group: Group, column: str, cell: Cell, row: dict[str, Any], args,
                 log: common.Log, floors: dict[str, Group] | None = None) -> None:
    """Warm up, compare with eager, time; results go into ``row``; with ``floors`` (full-graph
    column -> its group), also time it interleaved with them (``paired_timing``). A function of its
    own so the step closure (which holds the compiled callable) dies on return:
    compileattn.compile's globals must be collectable before the next group compiles (see
    _reset_compilers)."""
    import torch

    import compileattn as ca

    try:
        md, ids, pos = bench.prepare(cell)
        with ca.set_forward_context(md, bench.caches), torch.no_grad():
            step = group.step(column, cell, ids, pos)
            first, out = warm_up(step, max(1, args.warmup))
            row["first_call_s"] = round(first, 3)
            err = common.rel_error(out[: cell.tokens], bench.reference[cell])
            row["rel_err"] = err
            del out
            tol = row["tolerance"] = args.tolerance if args.tolerance is not None else TOLERANCE[str(bench.dtype).removeprefix("torch.")]
            if not err <= tol:
                row.update(status="FAILED", reason=f"output differs from eager: rel. error {err:.3g} > {tol}")
            else:
                row.update(status="ok", **common.summarize_us(timed_steps(step, args.steps)))
                # ca-full replays its full graph on uniform-decode steps only
                graph = group.captured_graph(column, ids.shape[0]) if cell.kind == "decode" or column != "ca-full" else None
                if graph is not None:
                    row["graph_gpu_us"] = replay_gpu_us(graph)
                if floors:
                    # its own try: the column's row above is measured and ok whatever happens to
                    # the side-by-side rounds (a floor's replay failing costs the pairing only)
                    try:
                        paired = paired_timing(step, column, floors, ids, pos, args.steps)
                    except Exception as exc:  # noqa: BLE001
                        row["paired_error"] = common.short_error(exc)
                        log("".join(traceback.format_exc(limit=8)).rstrip())
                        try:
                            _sync()
                        except Exception:  # noqa: BLE001
                            pass
                    else:
                        if paired is not None:
                            row["paired"] = paired
    except Unavailable as exc:
        row.update(status="unavailable", reason=str(exc))
    except Exception as exc:  # noqa: BLE001  (one failing column must not cost the table)
        row.update(status="error", reason=common.short_error(exc))
        log("".join(traceback.format_exc(limit=8)).rstrip())
        try:
            _sync()
        except Exception:  # noqa: BLE001
            pass
    paired = row.get("paired")
    log(f"  {column:16s} {cell.name:34s} " + (
        f"p50 {row['p50_us']:9.1f}  p90 {row['p90_us']:9.1f}  p99 {row['p99_us']:9.1f} µs"
        f"  (first call {row['first_call_s']:.2f} s)" if row["status"] == "ok"
        else f"{row['status']}: {row['reason']}")
        + ("; interleaved p50 " + ", ".join(f"{c} {v:.1f}" for c, v in paired["p50_us"].items()) if paired else "")
        + (f"; side-by-side timing failed: {row['paired_error']}" if row.get("paired_error") else ""))


def run_model(name: str, args, budget: common.Budget, log: common.Log, rows: list[dict[str, Any]],
              stats: list[dict[str, Any]], checkpoint: Callable[[], None] | None = None,
              byte_counts: dict[str, Any] | None = None) -> None:
    """Every selected column on every cell of one model, appended to ``rows`` / ``stats`` as they
    finish (so a caller still has them if a later group crashes); ``checkpoint()`` after each
    measured cell and each group (with its stats).
    ``byte_counts[name]`` receives the model's ``step_byte_counts``."""
    cells = make_cells(args)
    bench = Bench(name, cells, args, log)
    if byte_counts is not None:
        byte_counts[name] = bench.byte_counts
    backend = decode_backends(bench)[0]
    log(f"{name}: decode attention backend {backend.name} (capturable: {backend.capturable}); cells: "
        + "; ".join(c.name for c in cells))
    for cell in cells:
        bench.reference[cell] = eager_reference(bench, cell)
    floors: dict[str, Group] = {}  # full-graph column -> its group, while paired columns are to come
    #: full-graph column -> the cells its own row was ok in: a graph whose output failed the check
    #: against eager (or was not timed) is no floor for that cell, as in the ratios of ok rows.
    floor_cells: dict[str, set[Cell]] = {}
    for group_name, columns in GROUPS:
        wanted = [c for c in columns if c in args.columns]
        if not wanted:
            continue
        if floors and group_name not in FLOOR_GROUPS and not set(wanted) & set(PAIRED_COLUMNS):
            floors.clear()  # nothing later is paired with them: their graphs' memory goes back
            _reset_compilers()
        # A compiled group's first call compiles for tens of seconds (minutes for Llama-8B): do not
        # start one that could only be cut off by the caller's timeout.
        if budget.exceeded(reserve=0.0 if group_name == "eager" else GROUP_RESERVE_S):
            rows += [{**base_row(name, cell, col, bench.padded(cell)), "status": "skipped", "reason": budget.reason()}
                     for col in wanted for cell in cells]
            continue
        log(f"{name}: {group_name} ({', '.join(wanted)})")
        group = None
        try:
            group = make_group(group_name, bench)
        except Exception as exc:  # noqa: BLE001
            status = "unavailable" if isinstance(exc, Unavailable) else "error"
            reason = str(exc) if isinstance(exc, Unavailable) else common.short_error(exc)
            rows += [{**base_row(name, cell, col, bench.padded(cell)), "status": status, "reason": reason}
                     for col in wanted for cell in cells]
            continue
        first_seen: dict[str, list[float]] = {}
        for cell in cells:
            for column in wanted:
                row = base_row(name, cell, column, bench.padded(cell))
                rows.append(row)
                if budget.exceeded():
                    row.update(status="skipped", reason=budget.reason())
                    continue
                measure_cell(bench, group, column, cell, row, args, log,
                             floors={c: g for c, g in floors.items() if cell in floor_cells.get(c, ())}
                             if column in PAIRED_COLUMNS else None)
                if row["status"] == "ok" and group_name in FLOOR_GROUPS and column in report.FULL_GRAPHS:
                    floor_cells.setdefault(column, set()).add(cell)
                if row.get("first_call_s") is not None:
                    first_seen.setdefault(column, []).append(row["first_call_s"])
                if checkpoint is not None:  # a cell can take a minute (a compile): a timeout kill
                    checkpoint()            # then loses that cell only, not its group's others
        for column in wanted:
            try:
                extra = group.stats(column)
            except Exception as exc:  # noqa: BLE001
                extra = {"stats_error": common.short_error(exc)}
            firsts = first_seen.get(column, [])
            stats.append({"run": 0, "model": name, "column": column, "first_call_s": firsts[0] if firsts else None,
                          "later_first_call_max_s": max(firsts[1:]) if len(firsts) > 1 else None, **extra})
            log(f"  {column}: first call {firsts[0] if firsts else 0:.2f} s, "
                f"later cells' first calls up to {max(firsts[1:]) if len(firsts) > 1 else 0:.2f} s, {extra}")
        if group_name in FLOOR_GROUPS:
            floors.update({c: group for c in wanted if c in report.FULL_GRAPHS})
        del group
        _reset_compilers()
        if checkpoint is not None:
            checkpoint()
    floors.clear()
    bench.close()
    del bench
    _reset_compilers()


# ----------------------------------------------------------------------------------------------
# Cold / warm compile in subprocesses


def run_probes(name: str, args, budget: common.Budget, log: common.Log) -> list[dict[str, Any]]:
    """compileattn's cold and warm start for this model: ``coldwarm.py``'s phases (fresh processes)."""
    import coldwarm

    # coldwarm's own parser, so each of its options has its default there (workers, ...)
    spec = coldwarm.parse_args(["--device", DEVICE, "--backend", args.backend]
                               + (["--llama-layers", str(args.llama_layers)] if args.llama_layers else []))
    with coldwarm.phase_dirs() as dirs:
        return [{"run": 0, **coldwarm.run_phase(name, phase, dirs, spec, budget, log)} for phase in ("cold", "warm")]


def run_benchmark(args, log: common.Log, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every model; ``checkpoint(payload)`` after each column group and cold/warm pair, so a run
    killed at its time limit still leaves what it finished on disk."""
    import torch

    from compileattn.backends.selector import get_backend

    budget = common.Budget(args.budget_s)
    env = common.environment()
    log(f"GPU {env['gpu']}; versions {env['versions']}")
    try:
        backend = get_backend(args.backend if args.backend != "auto" else "triton", DEVICE)
        backend_info = {"name": args.backend, "decode": backend.name, "capturable": bool(backend.capturable)}
    except Exception as exc:  # noqa: BLE001
        backend_info = {"name": args.backend, "error": common.short_error(exc)}
        log(f"attention backend {args.backend!r} unusable: {backend_info['error']}")
    bandwidth = common.copy_bandwidth(device=DEVICE)
    log(f"copy bandwidth {bandwidth['GBps']:.0f} GB/s (read + write, {bandwidth['method']}): the roofline's")
    rows: list[dict[str, Any]] = []
    stats: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    byte_counts: dict[str, Any] = {}
    run = {"label": args.label or f"{', '.join(args.models)} / {args.backend}", "env": env, "backend": backend_info,
           "budget_s": args.budget_s, "copy_bandwidth": bandwidth, "models": byte_counts}
    payload = {"benchmark": "latency",
               "config": {"models": args.models, "batches": args.batches, "contexts": args.contexts,
                          "columns": args.columns, "steps": args.steps, "warmup": args.warmup,
                          "mixed": None if args.no_mixed else {"decodes": args.mixed_decodes,
                                                               "prefill": args.mixed_prefill},
                          "llama_layers": args.llama_layers, "tolerance": args.tolerance if args.tolerance is not None else TOLERANCE,
                          "block_size": BLOCK_SIZE},
               "runs": [run], "rows": rows, "stats": stats, "probes": probes}

    def save(more_rows: Sequence[dict[str, Any]] = (), more_stats: Sequence[dict[str, Any]] = ()) -> None:
        if checkpoint is None:
            return
        run["elapsed_s"] = round(log.elapsed(), 1)
        checkpoint({**payload, "rows": rows + list(more_rows), "stats": stats + list(more_stats)})

    if "error" not in backend_info:
        for name in args.models:
            if args.cold_warm_only:
                pass
            elif budget.exceeded():
                for cell in make_cells(args):
                    rows += [{**base_row(name, cell, col, 0), "status": "skipped", "reason": budget.reason()}
                             for col in args.columns]
            else:
                model_rows: list[dict[str, Any]] = []
                model_stats: list[dict[str, Any]] = []
                try:
                    run_model(name, args, budget, log, model_rows, model_stats,
                              checkpoint=lambda: save(model_rows, model_stats), byte_counts=byte_counts)
                except Exception as exc:  # noqa: BLE001  (e.g. out of memory building the model)
                    log(f"{name} failed: {common.short_error(exc)}\n" + traceback.format_exc(limit=8).rstrip())
                    done = {(r["kind"], r["batch"], r["context"], r["column"]) for r in model_rows}
                    model_rows += [{**base_row(name, cell, col, 0), "status": "error",
                                    "reason": f"model run failed: {common.short_error(exc)}"}
                                   for cell in make_cells(args) for col in args.columns
                                   if (cell.kind, cell.batch, cell.context, col) not in done]
                    _reset_compilers()
                res = {"rows": model_rows, "stats": model_stats}
                rows += res["rows"]
                stats += res["stats"]
                torch.cuda.empty_cache()
                save()
            # After the model's columns (its memory is freed by then); needs ~30 s of budget left.
            if not args.no_cold_warm:
                probes += run_probes(name, args, budget, log)
                save()
    run["elapsed_s"] = round(log.elapsed(), 1)
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = common.Log()
    baseline = common.read_json(args.baseline) if args.baseline else None
    if args.merge:
        merged = report.merge_payloads([common.read_json(p) for p in args.merge])
        print(report.write_outputs(merged, args.output or args.out, args.no_plot, log, baseline), flush=True)
        return 0
    missing = common.cuda_missing_message("latency.py")
    if missing:
        print(missing, flush=True)
        return 0
    common.ensure_repo_on_path()
    payload = run_benchmark(args, log, checkpoint=lambda pl: report.write_outputs(
        pl, args.out, True, lambda _m: None, baseline))
    print(report.write_outputs(payload, args.out, args.no_plot, log, baseline), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
