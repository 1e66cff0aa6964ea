"""Rule 2 of docs/design.md: the FIFO of pending steps on a non-last rank."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class SlotRing(Generic[T]):
    """A FIFO of ``depth`` ring slots, starting with ``depth`` empty ones.

    Each step, :meth:`advance` pops the head (the slot reserved ``depth``
    steps ago) and reserves an empty tail; :meth:`fill_tail` puts the step's
    pending receive, if any, into that tail.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth = {depth} must be >= 1")
        self.depth = depth
        self._slots: deque[T | None] = deque([None] * depth)
        self.advanced = 0  # advance() calls; the last tail reserved is (advanced - 1) % depth

    def advance(self) -> T | None:
        """Pop the head and reserve an empty tail; return what the head held."""
        head = self._slots.popleft()
        self._slots.append(None)
        self.advanced += 1
        return head

    def head(self) -> T | None:
        """What the next :meth:`advance` will pop."""
        return self._slots[0]

    def fill_tail(self, item: T) -> None:
        """Put ``item`` in the tail slot reserved by the last :meth:`advance`."""
        self._slots[-1] = item

    def pending(self) -> Iterator[T]:
        """The filled slots, oldest first."""
        return (s for s in self._slots if s is not None)

    def clear(self) -> None:
        """Empty every slot (the ring keeps its depth)."""
        for i in range(self.depth):
            self._slots[i] = None
