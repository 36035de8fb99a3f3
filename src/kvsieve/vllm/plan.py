"""What kvsieve's vLLM scheduler tells its worker each step, and the rule that decides it.
Plain Python: no vLLM import.

Two lengths per request, kept apart (docs/vllm-design.md, "Two lengths"):

* the **logical length**: vLLM's ``num_computed_tokens``, the positions.  RoPE positions, the input
  token ids and every scheduler decision (prefill done? max_model_len?) keep using it unchanged;
* the **KV length**: tokens held in the request's blocks, ``logical - offset``.  Slot mapping,
  attention lengths and block allocation use it.

The scheduler owns ``offset`` per request and sends it with every step it schedules the request;
the worker keeps no offset of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Methods this skeleton can serve inside vLLM.  "full" runs every kvsieve class with no eviction
# (the exactness baseline); "streaming" keeps sinks + the most recent tokens and needs no scores,
# so it exercises compaction, block reclaim and the two lengths before the engine-neutral
# schedule (issue 48) is wired in.
SERVED = ("full", "streaming")


@dataclass(frozen=True)
class SieveSettings:
    """Server-wide settings, from ``additional_config["kvsieve"]`` (``kvsieve.vllm.engine_kwargs``)."""

    method: str = "full"
    budget: int | None = None
    sinks: int = 4
    interval: int = 16
    compress_prefill: bool = True
    record_queries: int = 0  # recent post-RoPE queries kept per (request, layer); 0: none recorded

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> "SieveSettings":
        config = dict(config or {})
        unknown = set(config) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"kvsieve: unknown vLLM setting(s) {sorted(unknown)}; known: "
                             f"{sorted(cls.__dataclass_fields__)}")
        settings = cls(**{k: v for k, v in config.items() if v is not None})
        if settings.method not in SERVED:
            raise ValueError(f"kvsieve: method {settings.method!r} is not served inside vLLM yet; "
                             f"served: {', '.join(SERVED)}")
        if settings.compresses:
            if settings.budget is None or settings.budget < 1:
                raise ValueError(f"kvsieve: method {settings.method!r} needs a budget of at least 1 token")
            if not 0 <= settings.sinks < settings.budget:
                raise ValueError(f"kvsieve: sinks {settings.sinks} must be below the budget {settings.budget}")
            if settings.interval < 1:
                raise ValueError(f"kvsieve: interval {settings.interval} must be at least 1")
        return settings

    @property
    def compresses(self) -> bool:
        return self.method != "full"


def keep_count(settings: SieveSettings, kv_len: int, decode_steps: int, recomputed: bool = False) -> int | None:
    """Tokens every (layer, kv head) of a request keeps when it is compressed now, or None when it
    is not.  Called by the scheduler before each step, for a request whose KV holds all its tokens
    but the last sampled one (its prompt done): ``kv_len`` tokens in its blocks, ``decode_steps``
    tokens generated into its KV since the prompt.  kvsieve's schedule (``policy.Schedule``):
    after the prompt when ``compress_prefill``, then every ``interval`` decode steps, down to the
    budget when over it.  The count is known here, before any score is computed, so the scheduler
    frees the tail blocks itself and the worker only fills the kept slots.  ``recomputed``: the
    request was preempted and has just recomputed its prompt and outputs at full length, which
    an unpreempted request never holds: it is compressed at once."""
    if not settings.compresses or settings.budget is None or kv_len <= settings.budget:
        return None
    due = (recomputed or (decode_steps == 0 and settings.compress_prefill)
           or (decode_steps > 0 and decode_steps % settings.interval == 0))
    return settings.budget if due else None


@dataclass(frozen=True)
class Compaction:
    """Compress one request before this step's forward pass.

    ``block_ids``: the request's blocks (KV cache group 0) before compaction, which hold its
    ``kv_len`` tokens; ``keep``: tokens each (layer, kv head) keeps, moved into the request's
    first slots; ``kept_blocks``: the blocks it keeps, enough for ``keep`` tokens and the token
    this step writes (the cut tail's first block serves it: the worker reads the old tokens out
    before the forward pass writes the new one, so no block is allocated while the cut ones are
    still held).  The scheduler has already cut the request's block list to ``kept_blocks`` and
    frees the rest once this step has run.  ``logical_len``: the request's ``num_computed_tokens``
    (its positions run 0 .. logical_len - 1)."""

    req_id: str
    block_ids: tuple[int, ...]
    kv_len: int
    keep: int
    kept_blocks: int
    logical_len: int


@dataclass
class SievePlan:
    """The scheduler's word for one step: compactions to apply before the forward pass, and the
    offset (logical - KV length) of every scheduled request that has one."""

    step: int
    compactions: list[Compaction] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)
