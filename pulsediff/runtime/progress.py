"""How the library reports progress without knowing who listens.

The core calls `begin`/`advance`/`end` on whatever object it is given; the
CLI passes a rich progress bar, the API default does nothing.
"""

from __future__ import annotations


class Progress:
    """No-op progress sink; subclass to display."""

    def begin(self, description: str, total_bytes: int, total_tensors: int, unit: str = "tensors") -> None:
        """`total_tensors` counts `unit`s: tensors, or files for a download."""

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        pass

    def end(self) -> None:
        pass


SILENT = Progress()


class Labelled(Progress):
    """Passes progress on under its own label: a loop of operations that each call their bar the
    same ("make" for every step of a series) shows which one runs ("make 3/9")."""

    def __init__(self, inner: Progress, label: str):
        self.inner = inner
        self.label = label

    def begin(self, description: str, total_bytes: int, total_tensors: int, unit: str = "tensors") -> None:
        self.inner.begin(self.label, total_bytes, total_tensors, unit)

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self.inner.advance(nbytes, tensors)

    def end(self) -> None:
        self.inner.end()
