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

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..attention import attention_probs, visible
from ..cache import DEAD_POS, LayerView
from ..schedule import cross_layer_scores, keep_set
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
                  queries: torch.Tensor | None, logical_len: int, scaling: float, layer_idx: int,
                  prompt_len: int | None = None) -> LayerView:
    """One request's layer as a scorer reads it (``engine.LayerReader``), a batch of one row.

    keys, values: [H_kv, S, D] (S = KV length); pos: [H_kv, S]; fields: {name: [H_kv, S]} (the view
    holds them as [1, H_kv, S] views, so a scorer's writes reach ``fields``); queries: [n, H_q, D]
    the request's last n post-RoPE queries, oldest first, at positions logical_len - n .. logical_len - 1
    (vLLM records every query row in position order), or None; prompt_len: the request's prompt when
    the policy keeps it (``LayerReader.prompt_len``), else None."""
    H, S = pos.shape
    recent = recent_pos = None
    if queries is not None:
        n = queries.shape[0]
        recent = queries.permute(1, 0, 2)[None]  # [1, H_q, n, D]
        recent_pos = torch.arange(logical_len - n, logical_len)[None]  # [1, n]
    meta = {"pos": pos[None], **{name: t[None] for name, t in fields.items()}}
    return LayerView(keys[None], values[None], torch.full((1, H), S, dtype=torch.long), meta, {}, recent, recent_pos,
                     scaling, {}, layer_idx, S, prompt_len=None if prompt_len is None else torch.tensor([prompt_len]))


def observe_since(scorer, layer: LayerView, queries: torch.Tensor, logical_len: int, since: int,
                  prompt_len: int) -> None:
    """Hand ``scorer.observe`` the attention rows of the request's queries at positions ``since`` ..
    ``logical_len - 1`` (those after its last compaction), as kvsieve's engine does: the prompt's
    (positions below ``prompt_len``) in one call, then one call per decode query; only the newest
    for a scorer that keeps the newest row alone (``observes_last_only``).

    queries: [n, H_q, D] the request's recorded queries, oldest first, at positions
    ``logical_len - n`` .. ``logical_len - 1``; each call's rows are [1, H_kv, G, T, S].  Each call
    sees the layer as it was then: slots appended after the call's last query are dead (their
    position DEAD_POS), so a scorer's ``live()`` and its writes leave them at their initial state."""
    n = queries.shape[0]
    first = logical_len - 1 if scorer.needs.observes_last_only else since
    if n == 0 or first < logical_len - n:
        raise RuntimeError(f"kvsieve: {scorer.name} observes the queries from position {first} on, but only the "
                           f"last {n} of {logical_len} were recorded")
    calls = [(first, min(prompt_len, logical_len))] if first < prompt_len else []
    calls += [(p, p + 1) for p in range(max(first, prompt_len), logical_len)]
    pos = layer.meta["pos"]  # [1, H_kv, S]
    for start, end in calls:
        rows = queries[start - (logical_len - n):end - (logical_len - n)]  # [T, H_q, D]
        query, qpos = rows.permute(1, 0, 2)[None], torch.arange(start, end)[None]  # [1, H_q, T, D], [1, T]
        then = dataclasses.replace(layer, meta={**layer.meta, "pos": pos.masked_fill(pos >= end, DEAD_POS)})
        allowed = visible(then.meta["pos"], qpos, layer.sliding_window)  # [1, H_kv, T, S]: causal by position
        scorer.observe(then, attention_probs(query, layer.keys, allowed, layer.scaling), qpos)
        layer.meta.update({name: t for name, t in then.meta.items() if name != "pos"})  # fields a scorer replaced


def compress_request(policy, layout: Layout, caches: list[torch.Tensor], scalings: list[float],
                     state: RequestState, c: Compaction,
                     queries_of: Callable[[int], torch.Tensor | None]) -> None:
    """Compress one request in place, layer by layer, to ``c.keep`` tokens per (layer, kv head).

    policy: the ``kvsieve.policy.Policy`` served; caches: every layer's KV cache tensor, read through
    ``layout``; scalings: each layer's softmax scale; state: the request's positions and fields,
    updated to the kept slots; queries_of(layer): the request's recorded queries [n, H_q, D] in that
    layer, all the ring holds (None when the scorer reads none).  A cross-layer scorer
    (``Needs.cross_layer``, TriAttention's ``per_head``) has every layer read first, and every layer
    keeps the tokens of the mean of their scores (``schedule.cross_layer_scores``)."""
    scorer, needs = policy.scorer, policy.scorer.needs
    L, H = len(caches), caches[0].shape[1]
    block_ids = torch.tensor(c.block_ids, dtype=torch.long)
    positions = state.positions(c.kv_len, L, H)  # [L, H, kv_len]
    fields = {name: state.field(name, init, c.kv_len, L, H) for name, init in needs.meta.items()}
    kept_prompt = c.prompt_len if policy.protect_prompt or policy.pin_prompt else None
    prompt_len = torch.tensor([c.prompt_len]) if policy.protect_prompt else None
    pinned = torch.tensor([min(c.prompt_len, policy.budget)]) if policy.pin_prompt else None
    seen = torch.tensor([c.logical_len])  # [1]: the next token's position
    # a scorer with its own count rule (LagKV) has no budget: keep_set checks its select keeps c.keep
    budget = policy.budget if needs.uses_budget else c.keep

    def read(layer: int) -> LayerView:
        """Layer ``layer`` of the request as the scorer reads it, its attention rows observed."""
        keys, values = gather(layout, caches[layer], block_ids, c.kv_len)  # [H, kv_len, D] copies
        queries = queries_of(layer) if needs.query_window or needs.observes else None  # [n, H_q, D]
        window = None if not needs.query_window else queries[queries.shape[0] - min(needs.query_window,
                                                                                    queries.shape[0]):]
        view = request_layer(keys, values, positions[layer], {n: t[layer] for n, t in fields.items()},
                             window, c.logical_len, scalings[layer], layer, kept_prompt)
        if needs.observes:
            observe_since(scorer, view, queries, c.logical_len, state.next_pos, c.prompt_len)
        return view

    views = [read(layer) for layer in range(L)] if needs.cross_layer else None
    scores = None if views is None else cross_layer_scores(views, policy, seen,
                                                           prompt_len if pinned is None else pinned)
    new_pos, new_fields = [], {name: [] for name in fields}
    for layer, cache in enumerate(caches):
        view = read(layer) if views is None else views[layer]
        keys, values = view.keys[0], view.values[0]  # [H, kv_len, D]
        kept = keep_set(view, policy, budget, seen, prompt_len, pinned, scores)[0]  # [H, keep], slot order
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
