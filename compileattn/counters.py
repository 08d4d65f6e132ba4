"""Counters of compile-time and run-time events, for users' tests and ours.

``with compileattn.counters.expect(dynamo_graphs=1, pieces=5): ...`` asserts exact deltas of the
named counters over the block (the idiom vLLM's tests use), so a test states what compiling or
running must cost rather than timing it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator


@dataclasses.dataclass
class Counters:
    #: FX graphs Dynamo handed to the compileattn backend (one per compile, more means recompiles).
    dynamo_graphs: int = 0
    #: Pieces produced by the split pass (N splitting ops -> up to N + 1 pieces).
    pieces: int = 0
    #: Call sites of nested compile regions (a decoder layer traced once for all) flattened back
    #: into the graph before it is split (passes/regions.py; one inside a region counts once).
    regions_inlined: int = 0
    #: Distinct subgraphs those calls used: the layers Dynamo actually traced.
    region_subgraphs: int = 0
    #: Pieces compiled by the piece compiler (Inductor etc.), not counting cache loads.
    backend_compiles: int = 0
    #: Of those, static-shape compiles done by a worker process (compilation/compile_pool.py).
    static_compiles_in_workers: int = 0
    #: Of those, dynamic-shape compiles done by a worker process (while the compiling process
    #: compiled other pieces).
    dynamic_compiles_in_workers: int = 0
    #: Piece compiles (dynamic or static) that took the code of an identical earlier piece of the
    #: same graph instead (compilation/piece_signature.py).
    piece_reuses: int = 0
    #: Times a static size's CUDA graphs were dropped because its static pieces landed after the
    #: compile returned (compilation/landing.py): once per size per step that installed some of
    #: them; the size's next step captures them again.
    static_landings: int = 0
    #: Pieces loaded from the compile cache instead of compiled.
    cache_hits: int = 0
    #: Pieces looked up in the compile cache and not found.
    cache_misses: int = 0
    #: Collectives (torch's functional collectives, e.g. tensor-parallel all-reduces) inside compiled
    #: pieces, so inside their CUDA graphs.
    collectives_in_pieces: int = 0
    #: Collectives that ended up in a splitting op's submodule (run eagerly between graphs).
    collectives_at_splits: int = 0
    #: CUDA graphs captured (one per piece per size in piecewise mode, one per size in full mode).
    cudagraph_captures: int = 0
    #: Forward steps served by replaying CUDA graphs (piecewise or full).
    cudagraph_replays: int = 0
    #: Of those, the steps served by one CUDA graph of the whole forward (full-decode mode).
    full_graph_steps: int = 0
    #: Of those, the steps ``@compileattn.compile`` replayed without running Dynamo's code
    #: (compilation/replay.py).
    full_graph_direct_steps: int = 0
    #: CUDA-graph steps that compared every parameter input with its address at capture because a
    #: module registered a parameter, buffer or submodule since the last one
    #: (compilation/module_watch.py).
    module_rechecks: int = 0
    #: Of those, the ones that found a parameter replaced and dropped every CUDA graph (each size's
    #: next graph step captures them again).
    parameter_recaptures: int = 0
    #: Graph steps whose scalar graph input (a Python float or int Dynamo passes as a 0-dim CPU
    #: tensor, baked into a CUDA graph at capture) held another value than at its size's capture:
    #: that size's graphs were dropped and captured again.
    scalar_recaptures: int = 0
    #: Dispatchers that stopped capturing CUDA graphs because a scalar graph input kept changing
    #: (``dispatch.SCALAR_RECAPTURES_BEFORE_EAGER``): their steps run the compiled pieces eagerly.
    scalar_graphs_off: int = 0
    #: Forward steps that ran without CUDA graphs (too many tokens, or graphs off).
    eager_steps: int = 0
    #: Calls that ran the dynamic-shape pieces without CUDA graphs or static pieces because their
    #: dynamic sizes other than the token count were not those of the compiled call, which graphs
    #: and static pieces hold, or cannot be read from a call (compilation/pinned_sizes.py).
    unpinned_steps: int = 0

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator["Counters"]:
        """Assert that each named counter grows by exactly the given amount inside the block."""
        unknown = sorted(set(deltas) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown counter(s) {unknown}")
        before = self.snapshot()
        yield self
        after = self.snapshot()
        wrong = {k: (after[k] - before[k], v) for k, v in deltas.items() if after[k] - before[k] != v}
        if wrong:
            detail = ", ".join(f"{k}: got +{got}, expected +{want}" for k, (got, want) in wrong.items())
            raise AssertionError(f"compileattn counters: {detail}")


counters = Counters()
