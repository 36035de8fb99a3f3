"""The boundary between the schedule and an engine's KV store: what a store must offer.

A method decides *what* to keep, an engine decides *where* KV lives.  ``kvsieve.schedule`` asks
a method for scores over a read-only view of one layer, turns them into keep-sets per (row, kv
head) and hands those to the layer through the two calls below; it never touches storage
otherwise.  ``kvsieve.cache.SieveCache`` implements it for transformers; a vLLM adapter would
implement the same calls on its block tables, and ``tests/test_engine.py`` runs the bundled model
on a plain dense tensor store that implements them in a few lines.

A keep-set comes in one of two forms (both [B, H_kv, ...], vectorised over rows and heads):

* **gather** ``compact(kept_idx [B, H_kv, K], new_lengths [B, H_kv], capacity, max_len)``: slot
  ``j < new_lengths`` of the layer afterwards holds what slot ``kept_idx[..., j]`` held; slots past
  the new length are dead.  The store may reallocate to ``capacity`` slots per head.
* **in place** ``evict(drop_idx [B, H_kv, m], drop_count [B, H_kv], max_len)``: the first
  ``drop_count`` of ``drop_idx`` (distinct live slots) are dropped; the live tokens of the tail
  that are not dropped move into the holes below the new length, the lowest tail slot into the
  lowest hole.  Chosen only for scorers that declare ``Needs.slot_order_free`` and keep the
  top of their scores (no ``Needs.selects``).

Both leave the same tokens in the same slots on every store, so two stores give the same
greedy tokens (``tests/test_engine.py``).  Per-token state (positions, declared fields) moves
with K/V; the layer keeps its own host-side bound ``max_len`` on the lengths.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch


class LayerReader(Protocol):
    """What a scorer reads of one layer (``SieveLayer`` and ``cache.LayerView`` both are one).

    Read-only, except the per-token fields a scorer declared in ``Needs.meta``: those are the
    scorer's own state, kept beside K/V by the store, and its ``observe`` updates them.
    """

    keys: torch.Tensor  # [B, H_kv, capacity, D] post-RoPE
    values: torch.Tensor  # [B, H_kv, capacity, D_v]
    lengths: torch.Tensor  # [B, H_kv] live slots, 0 .. length-1
    meta: dict[str, torch.Tensor]  # "pos" (DEAD_POS on dead slots) and declared fields, [B, H_kv, capacity]
    sums: dict[str, torch.Tensor]  # running sums (cache.KV_SUMS) the store keeps; {} where it keeps none
    recent_queries: torch.Tensor | None  # [B, H_q, w, D] the last w post-RoPE queries (Needs.query_window)
    recent_query_pos: torch.Tensor | None  # [B, w]
    scaling: float | None  # the attention's softmax scale
    sliding_window: int | None
    step_results: dict[str, Any]  # what this step's attention pass computed for the scorer
    layer_idx: int
    max_len: int  # host-side bound on lengths.max()
    prompt_len: torch.Tensor | None  # [B] each row's prompt when the policy keeps it (protected or pinned), else None

    def live(self) -> torch.Tensor: ...  # [B, H_kv, capacity] bool

    def view(self): ...  # a cache.LayerView of the same tensors


class StoreLayer(LayerReader, Protocol):
    """One layer of a store as the schedule changes it."""

    capacity: int  # slots per (row, kv head) allocated now
    capacity_hint: int | None  # slots the schedule plans never to exceed (None: no plan)

    def compact(self, kept_idx: torch.Tensor, new_lengths: torch.Tensor, capacity: int, max_len: int) -> None: ...

    def evict(self, drop_idx: torch.Tensor, drop_count: torch.Tensor, max_len: int | None = None) -> None: ...

    def set_max_len(self, max_len: int) -> None: ...  # after an in-place eviction inside a compiled step

    def set_capacity_hint(self, hint: int) -> None: ...

    def reserve(self, needed: int) -> None: ...


class Store(Protocol):
    """A store of every layer plus each row's count of seen tokens."""

    layers: Sequence[StoreLayer]
    seen_tokens: torch.Tensor | None  # [B] real tokens each row has seen: the next token's position
    prompt_len: torch.Tensor | None  # [B] each row's prompt, once recorded (a kept prompt: protected or pinned)
    prompt_max: int  # host-side bound on prompt_len

    def set_seen(self, seen_tokens: torch.Tensor) -> None: ...

    def set_prompt(self, prompt_len: torch.Tensor) -> None: ...  # every layer's prompt_len reads it too
