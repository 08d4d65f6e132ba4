"""Clean-up: drop dead nodes before splitting.

Dynamo keeps the results of symbolic shape comparisons that the model code evaluated for its own
checks (``s77 == s77`` / ``not_``); they are pure and unused, and left in place they would add
SymInt traffic across piece boundaries.
"""
from __future__ import annotations

import torch.fx


def cleanup(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
