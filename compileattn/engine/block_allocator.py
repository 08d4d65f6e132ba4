"""The KV cache's free list of block ids."""
from __future__ import annotations

from typing import Iterable


class OutOfBlocksError(RuntimeError):
    """The KV cache has fewer free blocks than asked for."""


class BlockAllocator:
    """A free list of KV-cache block ids. Blocks come out lowest id first from a fresh allocator;
    freed blocks are reused before untouched ones (LIFO), which is what makes stale cache contents
    reachable by a wrong block table or slot mapping, and so testable."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} KV-cache blocks but only {len(self._free)} of {self.num_blocks} are free; "
                f"give the engine more num_blocks or run fewer/shorter sequences at once")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free, or not from this allocator)")
        for b in blocks:
            self._used.discard(b)
            self._free.append(b)
