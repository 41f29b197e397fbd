"""Mapping live tensor objects to handles without keeping them alive."""

from __future__ import annotations

import weakref

import torch


class HandleMap:
    """id(tensor) -> handle, guarded by a weak reference so a recycled id never aliases."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[int, weakref.ref]] = {}

    @property
    def table(self) -> dict[int, tuple[int, weakref.ref]]:
        """The raw id -> (handle, weak reference) table, for generated code on the hot path."""
        return self._entries

    def get(self, tensor: torch.Tensor) -> int | None:
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[1]() is tensor:
            return entry[0]
        return None

    def set(self, tensor: torch.Tensor, handle: int) -> None:
        self._entries[id(tensor)] = (handle, weakref.ref(tensor))

    def live(self) -> dict[int, torch.Tensor]:
        """handle -> tensor for every mapped tensor that is still alive (last binding wins)."""
        alive = {}
        for handle, ref in self._entries.values():
            tensor = ref()
            if tensor is not None:
                alive[handle] = tensor
        return alive

    def drop_from(self, limit: int) -> None:
        """Forget every binding to a handle >= limit."""
        for key in [k for k, v in self._entries.items() if v[0] >= limit]:
            del self._entries[key]  # in place: generated code holds the table itself

    def copy(self) -> HandleMap:
        other = HandleMap()
        other._entries = dict(self._entries)
        return other
