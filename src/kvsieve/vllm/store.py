"""The vLLM adapter of kvsieve's store protocol (``kvsieve.engine``): one request's paged KV as
the schedule reads it, at the moment the scheduler compresses it.  Plain torch: no vLLM import.

For each layer of the request, ``request_layer`` builds a read-only ``engine.LayerReader`` (a
``cache.LayerView`` of one row): keys and values gathered dense, ``[1, H_kv, kv_len, D]``, from the
request's blocks (``paged.gather``); each slot's logical position and each per-token field the
scorer declares (``Needs.meta``), kept per request between compactions (``RequestState``); the
request's recorded post-RoPE queries (``attention.QueryRecorder``) where the scorer declares
``Needs.query_window``.  kvsieve's own schedule then chooses the kept slots
(``schedule.keep_set``: the scorer, ``protected_scores``'s sinks, recent window and protected
prompt, the top ``keep`` or the scorer's own ``select``), with the count the scheduler fixed,
equal in every (layer, kv head) (one block table per request: AMS Appendix E), and
``compress_request`` writes them into the request's first slots (``paged.write_``), the
positions and fields moving with them.  No method's math is written here.

Scorers that observe attention rows are served when they keep only the newest query's row
(``Needs.observes_last_only``, TOVA): that row is recomputed here from the last recorded query
over the request's KV, exactly the row kvsieve's own engine hands ``observe`` before the same
compression.  Every slot of a request is live (its length is its KV length), so no slot is dead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..attention import attention_probs, visible
from ..cache import LayerView
from ..schedule import keep_set
from .paged import Layout, gather, write_
from .plan import Compaction


@dataclass
class RequestState:
    """What the worker keeps of one request between compactions: the logical position ``pos`` and
    the scorer's declared per-token fields ``fields[name]`` of the ``kept`` first slots, each
    [L, H_kv, kept], from its last compaction; the slots appended since run on from ``next_pos``
    in order, with each field's initial value (``Needs.meta``)."""

    pos: torch.Tensor | None = None
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    next_pos: int = 0

    @property
    def kept(self) -> int:
        return 0 if self.pos is None else self.pos.shape[-1]

    def positions(self, kv_len: int, layers: int, heads: int) -> torch.Tensor:
        """[L, H_kv, kv_len] the logical position of every slot."""
        tail = torch.arange(self.next_pos, self.next_pos + kv_len - self.kept).expand(layers, heads, -1)
        return tail if self.pos is None else torch.cat([self.pos, tail], dim=-1)

    def field(self, name: str, init: float, kv_len: int, layers: int, heads: int) -> torch.Tensor:
        """[L, H_kv, kv_len] float32 per-token field ``name``: kept values, then ``init`` on appended slots."""
        tail = torch.full((layers, heads, kv_len - self.kept), float(init))
        return tail if name not in self.fields else torch.cat([self.fields[name], tail], dim=-1)


def request_layer(keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, fields: dict[str, torch.Tensor],
                  queries: torch.Tensor | None, logical_len: int, scaling: float, layer_idx: int) -> LayerView:
    """One request's layer as a scorer reads it (``engine.LayerReader``), a batch of one row.

    keys, values: [H_kv, S, D] (S = KV length); pos: [H_kv, S]; fields: {name: [H_kv, S]} (the view
    holds them as [1, H_kv, S] views, so a scorer's writes reach ``fields``); queries: [n, H_q, D]
    the request's last n post-RoPE queries, oldest first, at positions logical_len - n .. logical_len - 1
    (vLLM records every query row in position order), or None."""
    H, S = pos.shape
    recent = recent_pos = None
    if queries is not None:
        n = queries.shape[0]
        recent = queries.permute(1, 0, 2)[None]  # [1, H_q, n, D]
        recent_pos = torch.arange(logical_len - n, logical_len)[None]  # [1, n]
    meta = {"pos": pos[None], **{name: t[None] for name, t in fields.items()}}
    return LayerView(keys[None], values[None], torch.full((1, H), S, dtype=torch.long), meta, {}, recent, recent_pos,
                     scaling, {}, layer_idx, S)


def observe_last_query(scorer, layer: LayerView) -> None:
    """Hand ``scorer.observe`` the newest query's attention row over the layer, [1, H_kv, G, 1, S]:
    what kvsieve's attention pass hands it on the step before a compression (observes_last_only)."""
    if layer.recent_queries is None or layer.recent_queries.shape[2] == 0:
        raise RuntimeError(f"kvsieve: {scorer.name} observes the newest query, but none was recorded")
    query, qpos = layer.recent_queries[:, :, -1:], layer.recent_query_pos[:, -1:]  # [1, H_q, 1, D], [1, 1]
    probs = attention_probs(query, layer.keys, visible(layer.meta["pos"], qpos, layer.sliding_window), layer.scaling)
    scorer.observe(layer, probs, qpos)


def compress_request(policy, layout: Layout, caches: list[torch.Tensor], scalings: list[float],
                     state: RequestState, c: Compaction,
                     queries_of: Callable[[int], torch.Tensor | None]) -> None:
    """Compress one request in place, layer by layer, to ``c.keep`` tokens per (layer, kv head).

    policy: the ``kvsieve.policy.Policy`` served; caches: every layer's KV cache tensor, read through
    ``layout``; scalings: each layer's softmax scale; state: the request's positions and fields,
    updated to the kept slots; queries_of(layer): the request's recorded queries [n, H_q, D] in that
    layer (None when the scorer reads none)."""
    scorer, needs = policy.scorer, policy.scorer.needs
    L, H = len(caches), caches[0].shape[1]
    block_ids = torch.tensor(c.block_ids, dtype=torch.long)
    positions = state.positions(c.kv_len, L, H)  # [L, H, kv_len]
    fields = {name: state.field(name, init, c.kv_len, L, H) for name, init in needs.meta.items()}
    prompt_len = torch.tensor([c.prompt_len]) if policy.protect_prompt else None
    seen = torch.tensor([c.logical_len])  # [1]: the next token's position
    new_pos, new_fields = [], {name: [] for name in fields}
    for layer, cache in enumerate(caches):
        keys, values = gather(layout, cache, block_ids, c.kv_len)  # [H, kv_len, D] copies
        view = request_layer(keys, values, positions[layer], {n: t[layer] for n, t in fields.items()},
                             queries_of(layer) if needs.query_window else None, c.logical_len, scalings[layer], layer)
        if needs.observes:
            observe_last_query(scorer, view)
        kept = keep_set(view, policy, policy.budget, seen, prompt_len)[0]  # [H, keep], in slot order
        if kept.shape[-1] != c.keep:
            raise RuntimeError(f"kvsieve: the schedule keeps {kept.shape[-1]} tokens, the scheduler planned {c.keep}")
        heads = torch.arange(H)[:, None]
        write_(layout, cache, block_ids, keys[heads, kept], values[heads, kept])
        new_pos.append(positions[layer].gather(-1, kept))
        for name in fields:  # a scorer may have replaced a field in the view's dict (AMS's credit)
            new_fields[name].append(view.meta[name][0].gather(-1, kept))
    state.pos = torch.stack(new_pos)  # [L, H, keep]
    state.fields = {name: torch.stack(t) for name, t in new_fields.items()}
    state.next_pos = c.logical_len
