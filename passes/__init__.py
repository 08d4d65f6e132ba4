"""FX passes of the compileattn backend. Each takes a GraphModule and returns one, and is testable
on CPU with a toy graph."""
from .cleanup import cleanup
from .hoist import hoist_shape_logic
from .kv_write import capture_kv_write
from .regions import RegionInlineError, inline_regions
from .split import Piece, is_splitting_node, split_graph

__all__ = ["Piece", "RegionInlineError", "capture_kv_write", "cleanup", "hoist_shape_logic", "inline_regions",
           "is_splitting_node", "split_graph"]
