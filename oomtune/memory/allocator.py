"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings), to predict
`torch.cuda.max_memory_reserved` from the storages a trial allocates and frees, in order. No torch here.

The rules it follows, as PyTorch 2.x documents and implements them for one stream with the default config (no
`max_split_size_mb`, no expandable segments, no garbage-collection threshold):

- Every request is rounded up to a multiple of 512 bytes (the smallest block).
- Requests of at most 1 MiB come from the small pool, larger ones from the large pool; a block never moves
  between pools.
- A request takes the smallest cached free block of its pool that is large enough (best fit; among equal sizes,
  the lowest address).
- Where no cached block fits, a new segment is reserved with cudaMalloc: 2 MiB for a small request, 20 MiB for a
  large request under 10 MiB, and the request rounded up to a multiple of 2 MiB above that.
- A block larger than the request is split, and the rest stays cached, when the rest is at least 512 bytes (small
  pool) or more than 1 MiB (large pool); otherwise the whole block is handed out.
- A freed block merges with its free neighbours in the same segment. Segments never merge with one another, so a
  request larger than every segment needs a new one even when the cached free bytes would hold it.
- When cudaMalloc would pass the device's capacity, the allocator frees every cached segment that is entirely
  free (cudaFree) and tries once more; only then is the request out of memory.

Reserved memory is the sum of the segments' sizes; its peak is what `max_memory_reserved` reports."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KiB, MiB = 1 << 10, 1 << 20
MIN_BLOCK = 512  # kMinBlockSize: every size is rounded to a multiple of this
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request served from the small pool
SMALL_SEGMENT = 2 * MiB  # kSmallBuffer: the segment a small request reserves
LARGE_SEGMENT = 20 * MiB  # kLargeBuffer: the segment a large request under MIN_LARGE_ALLOC reserves
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here the segment is the request rounded to ROUND_LARGE
ROUND_LARGE = 2 * MiB  # kRoundLarge


def rounded(nbytes: int) -> int:
    """A storage as oomtune's tracker counts it: up to a multiple of 512 bytes (0 stays 0)."""
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def round_size(nbytes: int) -> int:
    """A request's size as the allocator serves it: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """What cudaMalloc is asked for when no cached block can serve a (rounded) request of `size`."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False, slots=True)
class Block:
    segment: int  # the segment's id
    offset: int  # bytes from the segment's start
    size: int
    small: bool
    free: bool = True
    prev: Block | None = None  # neighbours in the same segment
    next: Block | None = None


class OutOfMemory(Exception):
    """The modelled allocator cannot serve a request within its capacity."""


@dataclass
class CachingAllocatorModel:
    """malloc(key, nbytes) / free(key), in the order a trial makes them; reserved_bytes and peak_reserved_bytes
    as the CUDA caching allocator would report them. `capacity_bytes`: the card's memory (None: unlimited).
    `overflows`: at the capacity it frees the cached segments as the card's allocator does, then reserves past the
    capacity instead of running out (the probe's prior, which reports how far past the budget a size goes)."""

    capacity_bytes: int | None = None
    overflows: bool = False
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    allocated_bytes: int = 0  # the blocks handed out (rounded): max_memory_allocated's count
    peak_allocated_bytes: int = 0
    segments: dict[int, int] = field(default_factory=dict)  # segment id -> size
    _free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _blocks: dict[tuple[int, int, int], Block] = field(default_factory=dict)  # free blocks by key
    _handed: dict[object, Block] = field(default_factory=dict)  # the caller's key -> its block
    _first: dict[int, Block] = field(default_factory=dict)  # segment id -> its first block
    _next_segment: int = 0

    # -- the caller's side ------------------------------------------------------------------------
    def malloc(self, key: object, nbytes: int) -> None:
        if nbytes <= 0:
            return
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK  # round_size's (at least MIN_BLOCK: nbytes > 0)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))  # best fit: the smallest free block that holds it
        block = self._blocks[pool[i]] if i < len(pool) else self._new_segment(size, small)
        self._take(block)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:  # split: the rest stays cached
            split = Block(block.segment, block.offset + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = split
            block.next, block.size = split, size
            self._cache(split)
        block.free = False
        self._handed[key] = block
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes

    def resize(self, key: object, nbytes: int) -> None:
        """`key`'s storage now holds `nbytes` (new, or resized in place as FSDP does): the new block is taken
        before the old one is freed, as a resize copies from the old into the new."""
        if key not in self._handed:
            self.malloc(key, nbytes)
            return
        old = self._handed.pop(key)
        try:
            self.malloc(key, nbytes)
        except OutOfMemory:
            self._handed[key] = old  # the storage keeps its block
            raise
        self._handed["resized", key] = old
        self.free(("resized", key))

    def free(self, key: object) -> None:
        block = self._handed.pop(key, None)
        if block is None:
            return
        self.allocated_bytes -= block.size
        block.free = True
        prev, after = block.prev, block.next
        if prev is not None and prev.free:
            self._take(prev)
            self._merge(block, prev)
        if after is not None and after.free:
            self._take(after)
            self._merge(block, after)
        self._cache(block)

    def reset_peak(self) -> None:
        """torch.cuda.reset_peak_memory_stats()."""
        self.peak_reserved_bytes, self.peak_allocated_bytes = self.reserved_bytes, self.allocated_bytes

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every segment that is entirely free is given back."""
        for seg, first in list(self._first.items()):
            if first.free and first.next is None and first.prev is None:
                self._take(first)
                self.reserved_bytes -= self.segments.pop(seg)
                del self._first[seg]

    # -- inside -----------------------------------------------------------------------------------
    def _new_segment(self, size: int, small: bool) -> Block:
        alloc = segment_size(size)
        if self.capacity_bytes is not None and self.reserved_bytes + alloc > self.capacity_bytes:
            self.empty_cache()  # what the allocator does before it gives up: free the cached segments, retry
            if self.reserved_bytes + alloc > self.capacity_bytes and not self.overflows:
                raise OutOfMemory(f"cannot reserve {alloc} bytes: {self.reserved_bytes} of "
                                  f"{self.capacity_bytes} reserved")
        seg = self._next_segment
        self._next_segment += 1
        self.segments[seg] = alloc
        self.reserved_bytes += alloc
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        block = Block(seg, 0, alloc, small)
        self._first[seg] = block
        self._cache(block)
        return block

    def _cache(self, block: Block) -> None:
        k = (block.size, block.segment, block.offset)  # best fit: the smallest, then the lowest address
        self._blocks[k] = block
        bisect.insort(self._free[block.small], k)

    def _take(self, block: Block) -> None:
        """Out of the free lists (handed out, or merged into a neighbour)."""
        k = (block.size, block.segment, block.offset)
        del self._blocks[k]
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, k)]

    def _merge(self, block: Block, other: Block) -> None:
        """Fold the free neighbour `other` into `block` (same segment, adjacent)."""
        if other is block.prev:
            block.offset = other.offset
            block.prev = other.prev
            if other.prev is not None:
                other.prev.next = block
            else:
                self._first[block.segment] = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size
