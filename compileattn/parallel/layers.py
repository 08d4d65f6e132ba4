"""Column- and row-parallel linears, and which attention heads each rank keeps.

Column-parallel: a rank keeps some *output* rows of the weight (and bias); its output is a slice
of the full output and needs no communication (q/k/v, gate/up). Row-parallel: a rank keeps the
matching *input* columns; its output is a partial sum, all-reduced over the group, and the bias
is added once, after the sum (o_proj, down_proj). One all-reduce per row-parallel layer, two per
decoder layer, all inside compiled pieces.

Heads: query heads split evenly. KV heads split evenly when there are at least as many as ranks;
with fewer (``num_kv_heads < tp``) each rank keeps the one KV head its query heads attend with,
so that head is replicated on ``tp / num_kv_heads`` ranks (as vLLM does). Each rank's attention
is then an ordinary GQA over its local heads.
"""
from __future__ import annotations

import dataclasses
import torch
from torch import nn

from ..argtypes import as_int, positive_int
from ..kv_cache import AttentionSpec
from .comm import all_reduce


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """The heads one rank of ``tp`` keeps of a layer with ``num_heads`` / ``num_kv_heads``."""

    num_heads: int
    num_kv_heads: int
    rank: int
    tp: int

    def __post_init__(self) -> None:
        # The int rule (argtypes): a config's numpy count is a count, a float or a bool none.
        for name in ("num_heads", "num_kv_heads", "tp"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name))
        rank = as_int(self.rank)
        if rank is None:
            raise TypeError(f"rank must be an int, got {self.rank!r}")
        object.__setattr__(self, "rank", rank)
        h, kv, tp = self.num_heads, self.num_kv_heads, self.tp
        if not 0 <= self.rank < tp:
            raise ValueError(f"rank {self.rank} is outside a TP group of {tp}")
        if h % kv:
            raise ValueError(f"num_heads ({h}) must be divisible by num_kv_heads ({kv})")
        if h % tp:
            raise ValueError(f"num_heads ({h}) must be divisible by the TP size ({tp})")
        if kv >= tp and kv % tp:
            raise ValueError(f"num_kv_heads ({kv}) must be divisible by the TP size ({tp})")
        if kv < tp and tp % kv:
            raise ValueError(f"with fewer KV heads ({kv}) than ranks ({tp}), the TP size must be a multiple of "
                             f"num_kv_heads so each rank's query heads share one KV head")

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.tp, 1)

    @property
    def q_heads(self) -> range:
        return range(self.rank * self.local_heads, (self.rank + 1) * self.local_heads)

    @property
    def kv_heads(self) -> range:
        if self.num_kv_heads >= self.tp:
            return range(self.rank * self.local_kv_heads, (self.rank + 1) * self.local_kv_heads)
        first = self.q_heads[0] // (self.num_heads // self.num_kv_heads)  # the KV head of our first query head
        return range(first, first + 1)

    def spec(self, full: AttentionSpec) -> AttentionSpec:
        """This rank's spec of a layer whose unsharded spec is ``full`` (same scale, window, softcap;
        the ALiBi slopes of this rank's query heads)."""
        if (full.num_heads, full.num_kv_heads) != (self.num_heads, self.num_kv_heads):
            raise ValueError(f"spec has {full.num_heads}/{full.num_kv_heads} heads, shard is for "
                             f"{self.num_heads}/{self.num_kv_heads}")
        slopes = full.alibi_slopes
        if slopes is not None:
            slopes = slopes[self.q_heads.start:self.q_heads.stop]
        return dataclasses.replace(full, num_heads=self.local_heads, num_kv_heads=self.local_kv_heads,
                                   alibi_slopes=slopes)


def head_rows(heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    """Row indices of ``heads`` in a projection whose rows are heads of ``head_dim``, from ``offset``."""
    return torch.arange(heads.start * head_dim, heads.stop * head_dim) + offset


def even_rows(size: int, rank: int, tp: int, offset: int = 0) -> torch.Tensor:
    """This rank's contiguous 1/tp of ``size`` rows (``size`` must divide)."""
    if size % tp:
        raise ValueError(f"{size} rows cannot be split evenly over {tp} ranks")
    part = size // tp
    return torch.arange(rank * part, (rank + 1) * part) + offset


def shard_columns_out(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """Column-parallel, in place: keep output ``rows`` of the weight and bias."""
    _check_linear(linear)
    rows = rows.to(linear.weight.device)
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight.index_select(0, rows).contiguous(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.index_select(0, rows).contiguous(), requires_grad=False)
    linear.out_features = len(rows)
    return linear


class RowParallelLinear(nn.Linear):
    """A linear over this rank's input columns; the partial outputs are summed over the group,
    then the (unsharded) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_name: str,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(nn.functional.linear(x, self.weight), self.group_name)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group_name!r}"


def row_parallel(linear: nn.Linear, columns: torch.Tensor, group_name: str) -> RowParallelLinear:
    """A ``RowParallelLinear`` holding input ``columns`` of ``linear`` (which is left as it was)."""
    _check_linear(linear)
    w = linear.weight
    out = RowParallelLinear.__new__(RowParallelLinear)
    nn.Module.__init__(out)  # no fresh parameters to initialise and throw away
    out.in_features, out.out_features, out.group_name = len(columns), linear.out_features, group_name
    with torch.no_grad():
        out.weight = nn.Parameter(w.index_select(1, columns.to(w.device)).contiguous(), requires_grad=False)
        out.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return out


def _check_linear(module: nn.Module) -> None:
    if type(module) is not nn.Linear:
        raise TypeError(f"tensor-parallel sharding handles nn.Linear, got {type(module).__name__}")
