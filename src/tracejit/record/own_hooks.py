"""The process-wide hooks tracejit registers itself, told apart from the user's.

While a call records (or replays at the aten level) tracejit follows module calls and optimizer
steps with torch.nn's and torch.optim's global hooks. Another traced function called meanwhile
(from an exclude_from_trace() block, or on another thread) must not take them for the user's:
its host-free guards and stand-ins would miss on every call, a fast path silently lost.
"""

from __future__ import annotations

from typing import Any

_OWN: set[int] = set()  # handle ids: torch numbers every hook handle from one counter, never reused


def own(handle: Any) -> Any:
    """Note a global hook's handle as tracejit's; returns it."""
    _OWN.add(handle.id)
    return handle


def remove_own(handle: Any) -> None:
    handle.remove()
    _OWN.discard(handle.id)


def foreign(hooks: dict) -> tuple:
    """The keys of a global hook dict that are not tracejit's. Iterated from a snapshot (`tuple`
    copies in one C call): another thread's traced call adds and removes its own hooks meanwhile."""
    return tuple(key for key in tuple(hooks) if key not in _OWN)


def any_foreign(dicts: tuple[dict, ...]) -> bool:
    return any(key not in _OWN for hooks in dicts for key in tuple(hooks))
