"""What a scorer's ``attach`` or a ``Hook`` may hand the decode loop for one call: host callbacks
(``HostHooks``), and the protocol of the hooks ``generate(..., hooks=[...])`` runs beside the policy.
Part of the scorer contract (``kvsieve.policy`` re-exports both)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol, runtime_checkable


@dataclass(frozen=True)
class HostHooks:
    """Host callbacks a scorer's ``attach`` may yield for the decode loop (a bare callable is
    ``on_tokens``).

    on_tokens : (token_ids [B, T], query_pos [B, T], rows [B]) -> None
        Called before every forward with the tokens about to be appended (``query_pos`` DEAD_POS
        on padding; ``rows``: each cache row's index in the original batch).
    on_rows_leave : (keep [B']) -> None
        Called right before finished rows leave the cache; ``keep`` are the rows that stay.
    """

    on_tokens: Callable | None = None
    on_rows_leave: Callable | None = None

    @staticmethod
    def of(yielded: "HostHooks | Callable | None") -> "HostHooks":
        """What an ``attach`` yielded, as ``HostHooks`` (a bare callable is ``on_tokens``)."""
        return yielded if isinstance(yielded, HostHooks) else HostHooks(on_tokens=yielded)


@runtime_checkable
class Hook(Protocol):
    """Something ``generate(..., hooks=[...])`` runs beside the policy for one call (SkipKV's
    steering, ``kvsieve.steering.Steering``): ``attach`` as a scorer's (may yield ``HostHooks``);
    ``settings()`` is stored in the call's settings record under ``name``, so results say what ran.
    """

    name: str

    def attach(self, model, tokenizer) -> ContextManager: ...

    def settings(self) -> dict: ...
