"""Page bookkeeping on plain integers: slot ids, a free list, and who holds what.

No tensors here (as in vLLM's block manager): the pool hands out slot ids, the store
(`store.py`) owns the tensors those ids index.
"""
from __future__ import annotations


class PoolExhausted(RuntimeError):
    """More pages were asked for than the pool has free."""


class PagePool:
    """A fixed number of page slots, handed out and taken back as integers.

    Slots are handed out lowest id first, so a fresh pool fills its buffer from the front
    and a step that frees everything and starts again reuses the same slots in the same
    order (deterministic layouts make runs comparable bit for bit).
    """

    def __init__(self, n_slots: int, page_bytes: int = 0) -> None:
        if n_slots < 0:
            raise ValueError(f"n_slots={n_slots} must be >= 0")
        self.n_slots = n_slots
        self.page_bytes = page_bytes
        # Stack of free ids, lowest on top.
        self._free: list[int] = list(range(n_slots - 1, -1, -1))
        self._used = bytearray(n_slots)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take `n` slots; raises PoolExhausted (naming the bytes) if fewer are free."""
        if n > len(self._free):
            missing = n - len(self._free)
            raise PoolExhausted(
                f"page pool exhausted: {n} pages requested, {len(self._free)} of {self.n_slots} free; "
                f"{missing} more pages ({missing * self.page_bytes / 2**20:.1f} MiB) are needed. "
                "Use a shorter context, offload pages to the host, or make the pool larger."
            )
        ids = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for i in ids:
            self._used[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Give slots back. Freeing a slot that is not in use is a bug, not a user error."""
        for i in ids:
            assert self._used[i], f"slot {i} freed twice or never allocated"
            self._used[i] = 0
        # Pushed in reverse, so allocating the same count next hands back the same ids in
        # the same order: a repeated step reuses the same layout.
        self._free.extend(reversed(ids))

    def grow(self, n_slots: int) -> None:
        """Add slots `self.n_slots .. n_slots-1` (the store grows its buffers to match)."""
        assert n_slots >= self.n_slots
        # New (higher) ids go under the free ones, which are handed out first.
        self._free = list(range(n_slots - 1, self.n_slots - 1, -1)) + self._free
        self._used.extend(bytes(n_slots - self.n_slots))
        self.n_slots = n_slots
