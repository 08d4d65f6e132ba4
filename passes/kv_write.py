"""Capture the K/V-cache write: split each unified attention op into write + attend.

``attention(q, k, v, out, layer)`` becomes ``dep = write_layer_kv(k, v, layer)`` followed by
``attend(q, out, dep, layer)``; the graph is then split at ``attend`` only, so the write lands in
the preceding piece and is replayed inside its CUDA graph. Measured on the H200 (op_overhead.md):
the Triton KV-write launch costs ~32 µs of host time per layer and the torch one ~58 µs, against
~9 µs for FlashAttention-4's cached kernel call: leaving the write in the eager op would cost more
than the attention itself. The write is capturable by contract (``AttentionBackend.write_layer_kv``:
no host sync, slot mapping in a persistent buffer).
"""
from __future__ import annotations

import torch
import torch.fx

from .split import is_splitting_node, op_arguments

UNIFIED = ("compileattn::attention",)


def capture_kv_write(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not is_splitting_node(node, UNIFIED):
            continue
        query, key, value, output, layer_name = op_arguments(node, ("query", "key", "value", "output", "layer_name"))
        with gm.graph.inserting_before(node):
            dep = gm.graph.call_function(torch.ops.compileattn.write_layer_kv.default, (key, value, layer_name))
            attend = gm.graph.call_function(torch.ops.compileattn.attend.default,
                                            (query, output, dep, layer_name))
        ev = key.meta.get("example_value") if isinstance(key, torch.fx.Node) else None
        if isinstance(ev, torch.Tensor):
            dep.meta["example_value"] = ev.new_empty(0)
        attend.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
        node.replace_all_uses_with(attend)
        gm.graph.erase_node(node)
        rewritten += 1
    gm.graph.lint()
    gm.recompile()
    gm.meta["compileattn_kv_write"] = rewritten
    return gm
