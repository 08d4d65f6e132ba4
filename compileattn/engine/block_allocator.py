"""The KV cache's block ids: reference counts, free pools and (optionally) the prefix cache's index."""
from __future__ import annotations

import collections
import operator
from typing import Iterable, Sequence

from ..argtypes import as_int, non_negative_int, positive_int
from ..kv_cache import check_num_blocks

#: A block's content key: (content id of the block before it, or None for a sequence's first
#: block; the block's token ids). Exact: two keys are equal only for equal token prefixes.
ContentKey = tuple[int | None, tuple[int, ...]]


def token_key(token_ids: Sequence[int]) -> tuple[int, ...]:
    """A block's token ids as the tuple of ints its content key holds, the same for ``register``
    and ``lookup``: a tensor's elements hash by identity, so a key of them would never be found
    again, and ``int()`` would truncate a float into another token (``operator.index`` refuses it
    with a TypeError)."""
    try:
        return tuple(map(operator.index, token_ids))
    except TypeError:
        raise TypeError(f"token_ids must be ints, got {list(token_ids)!r}") from None


class OutOfBlocksError(RuntimeError):
    """The KV cache has fewer free blocks than asked for."""


class BlockAllocator:
    """KV-cache block ids with reference counts: a block is free when no sequence holds it.

    Blocks come out lowest id first from a fresh allocator; freed blocks are reused before
    untouched ones (LIFO), which is what makes stale cache contents reachable by a wrong block
    table or slot mapping, and so testable.

    With ``enable_caching``, full blocks can be registered under a content key (``register``)
    and found again by token ids (``lookup``), so sequences with a common prefix hold the same
    blocks (``share``). A freed block that has a key keeps its K/V: it waits in a second free
    pool and is handed out (its key dropped) only when the pool of blocks without content is
    empty, least recently freed first. Keys chain through content ids (a fresh int per
    registered block, never reused), so a key names one exact token prefix: no hash collision
    can serve another prefix's K/V, and a block whose parent was evicted cannot be reached.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = False):
        num_blocks = check_num_blocks(positive_int(num_blocks, "num_blocks"))
        if not isinstance(enable_caching, bool):
            raise TypeError(f"enable_caching must be a bool, got {enable_caching!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks
        #: Free blocks without content, popped from the end (LIFO).
        self._free = list(range(num_blocks - 1, -1, -1))
        #: Free blocks whose content is registered, least recently freed first.
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._by_key: dict[ContentKey, tuple[int, int]] = {}  # key -> (block, content id)
        self._key_of: dict[int, ContentKey] = {}
        self._next_content_id = 0

    # -- allocation ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included (they are handed out when needed)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def _block_id(self, block) -> int:
        """``block`` as a block id of this allocator: an int by the int rule (``argtypes``: numpy's
        integers are block ids, a bool or a float is none), in ``[0, num_blocks)``, since a
        negative id would index the reference counts from the end, another block's."""
        b = block if type(block) is int else as_int(block)
        if b is None:
            raise TypeError(f"block ids must be ints, got {block!r}")
        if not 0 <= b < self.num_blocks:
            raise ValueError(f"block {b} is not allocated (not a block of this allocator: 0..{self.num_blocks - 1})")
        return b

    def can_allocate(self, n: int) -> bool:
        return non_negative_int(n, "n") <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each held once: blocks without content first, then the least recently
        freed cached ones, whose keys are dropped (their K/V is about to be overwritten)."""
        n = non_negative_int(n, "n")
        if n > self.num_free:
            raise OutOfBlocksError(
                f"asked for {n} KV-cache blocks but only {self.num_free} of {self.num_blocks} are free; "
                f"give the engine more num_blocks or run fewer/shorter sequences at once")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached_free.popitem(last=False)
                del self._by_key[self._key_of.pop(b)]
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one hold of each block (a sequence's blocks, in order). A block no one holds any
        more becomes free: into the cached pool if it has a key, its sequence's tail before its
        head (an evicted head would leave the rest unreachable), else into the LIFO pool."""
        blocks = [self._block_id(b) for b in blocks]
        counts = collections.Counter(blocks)
        for b, c in counts.items():
            if self._refs[b] < c:
                raise ValueError(f"block {b} is not allocated (double free, or not from this allocator)")
        released = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                released.append(b)
        for b in released:
            if b not in self._key_of:
                self._free.append(b)
        for b in reversed(released):
            if b in self._key_of:
                self._cached_free[b] = None

    def refcount(self, block: int) -> int:
        return self._refs[self._block_id(block)]

    # -- the prefix cache ----------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids`` in whole blocks (at most
        ``max_blocks``), first block first; [] without caching. Only reads: ``share`` takes them."""
        block_size = positive_int(block_size, "block_size")
        if max_blocks is not None:
            max_blocks = non_negative_int(max_blocks, "max_blocks")
        if not self.enable_caching:
            return []
        n = len(token_ids) // block_size
        if max_blocks is not None:
            n = min(n, max_blocks)
        blocks: list[int] = []
        parent = None
        for i in range(n):
            hit = self._by_key.get((parent, token_key(token_ids[i * block_size:(i + 1) * block_size])))
            if hit is None:
                break
            blocks.append(hit[0])
            parent = hit[1]
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks once more (out of the free pool if no one held them)."""
        blocks = [self._block_id(b) for b in blocks]
        for b in blocks:
            if b not in self._key_of:
                raise ValueError(f"block {b} holds no cached content; only blocks found by lookup can be shared")
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached_free[b]
            self._refs[b] += 1

    def register(self, block: int, parent: int | None, token_ids: Sequence[int]) -> int:
        """Record that allocated ``block`` holds the K/V of ``token_ids`` after the prefix named by
        content id ``parent`` (None: the sequence's first block); returns the content id to chain
        the next block to. If that content is already registered (two sequences computed the same
        prefix without sharing), ``block`` stays unregistered and the existing content id is
        returned, so the caller's chain continues through the registered copy."""
        if not self.enable_caching:
            raise ValueError("register needs an allocator made with enable_caching=True")
        block = self._block_id(block)
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is not allocated")
        if block in self._key_of:
            raise ValueError(f"block {block} is already registered")
        key = (parent, token_key(token_ids))
        existing = self._by_key.get(key)
        if existing is not None:
            return existing[1]
        cid = self._next_content_id
        self._next_content_id += 1
        self._by_key[key] = (block, cid)
        self._key_of[block] = key
        return cid

    def is_registered(self, block: int) -> bool:
        return block in self._key_of

    def content_id(self, block: int) -> int:
        """The content id of a registered block."""
        key = self._key_of.get(block)
        if key is None:
            raise ValueError(f"block {block} is not registered")
        return self._by_key[key][1]

    @property
    def num_registered(self) -> int:
        """Blocks whose content is registered, held or free."""
        return len(self._key_of)

    def set_caching(self, enabled: bool) -> None:
        """Switch prefix caching on or off; either way the cache starts empty (every key dropped,
        cached free blocks back into the LIFO pool)."""
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        self._by_key.clear()
        self._key_of.clear()
        self.enable_caching = enabled
