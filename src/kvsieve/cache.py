"""SieveCache: a transformers `Cache` whose layers hold a ragged, compactable KV store.

Layout of one layer (``SieveLayer``)::

    keys, values   [B, H_kv, capacity, D]   post-RoPE keys and values, never expanded to query heads
    lengths        [B, H_kv]                slots in use per (row, kv head): slots 0 .. length-1
    meta["pos"]    [B, H_kv, capacity]      true position of each cached token (int64, like position_ids)
    meta[name]     [B, H_kv, capacity]      per-token policy state (H2O sums, TS/MRI, ...) and
                                            per-token K/V statistics (``KV_FIELDS``: key norms, ...)
    sums[name]     [B, H_kv, D]             running sums over the live tokens (``KV_SUMS``), float64

Slot layout of one (row, kv head) while generating::

    slot:   0 1 2 ... length-1 | length ... capacity-1
            kept tokens,        | dead slots (pos = DEAD_POS)
            in position order   |

``pos`` does triple duty: it is the token's true position (positions count the row's real
tokens, left padding excluded), it marks dead and padding slots with ``DEAD_POS`` so
attention can mask them with one comparison (``pos <= query_pos``), and it is the causal
mask inside a prefill chunk.  Every piece of per-token state is moved by the same gather
(``SieveLayer.compact``), so nothing can drift out of step with K/V.

Slots hold tokens in position order, except after ``evict``: a scorer that declares
``slot_order_free`` (what it keeps does not depend on which slot neighbours which) and chooses by
its scores alone (no ``Needs.selects``) lets the engine drop a few tokens in place by moving the
newest tokens into the freed slots.

Capacity is a host-side integer.  Appends grow it in chunks; compaction gathers into a
new, smaller tensor, so evicted memory is really returned; ``evict`` keeps the allocation
(a bounded layer is already at its steady capacity, budget + interval).  ``max_len`` is a host-side
upper bound on ``lengths.max()`` kept without reading the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# Position given to dead and padding slots: larger than any query position, so
# ``pos <= query_pos`` is False for them.  Padding *queries* use it too, so they see every
# slot and never produce an all-masked (NaN) row.
DEAD_POS = torch.iinfo(torch.int32).max

# Per-token fields a layer computes from each token's own key and value as it is appended (a
# scorer names those it reads in ``Needs.kv_fields``), so scoring never re-reads the whole
# cache for them; they move with K/V like every other per-token field (0 on dead slots).
KV_FIELDS = {
    "key_norm": lambda k, v: k.float().norm(dim=-1),  # ||k_i||: Knorm, KeyDiff
    "value_sqnorm": lambda k, v: v.float().square().sum(dim=-1),  # ||v_i||^2: CAOTE's distances
}


# Per-layer sums over the live tokens of a per-token vector, [B, H_kv, D] in float64: added to as
# tokens are appended, subtracted from as they are evicted, recounted at compaction, so a scorer
# reading a mean over the cache (FastCAOTE's mean value, KeyDiff's anchor) saves a whole pass
# over V or K per step (``Needs.kv_sums`` names those it reads).
KV_SUMS = {
    "value_sum": lambda k, v: v.float(),  # FastCAOTE Eq. 22
    "unit_key_sum": lambda k, v: k.float() / k.float().norm(dim=-1, keepdim=True).clamp(min=1e-12),  # KeyDiff
}


def read_slots(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Slots ``slots`` [B, H_kv, m] of each (row, kv head) of a per-token field [B, H_kv, capacity]
    ([B, H_kv, m] out) or of K or V [B, H_kv, capacity, D] ([B, H_kv, m, D] out)."""
    if t.dim() == 4:
        slots = slots[..., None].expand(*slots.shape, t.shape[-1])
    return t.gather(2, slots)


def write_slots(t: torch.Tensor, slots: torch.Tensor, values: torch.Tensor | float) -> None:
    """``t``'s slots ``slots`` [B, H_kv, m] (distinct per row and head) of each (row, kv head) =
    ``values`` ([B, H_kv, m] or, for K and V, [B, H_kv, m, D]; or one number), in place: every
    write into a layer's store goes through here.

    Traced by ``torch.compile`` it is an ``index_put_``, which Inductor keeps in place; a graph
    that ``scatter_``s into one buffer twice (a step's append, then its eviction) makes Inductor
    copy the whole buffer for each, K and V of every layer on every compiled step.  Eagerly
    ``scatter_`` is the cheaper of the two (``index_put_`` broadcasts its indices on every call)."""
    if torch.compiler.is_compiling():
        B, H, _ = slots.shape
        rows = torch.arange(B, device=slots.device)[:, None, None]
        heads = torch.arange(H, device=slots.device)[None, :, None]
        t[rows, heads, slots] = values
        return
    if t.dim() == 4:
        slots = slots[..., None].expand(*slots.shape, t.shape[-1])
    t.scatter_(2, slots, values)


def kv_sum(layer, name: str) -> torch.Tensor:
    """[B, H_kv, D] float64 sum of ``KV_SUMS[name]`` over the layer's live tokens: the running sum
    when the layer keeps it, else (a layer or a scorer's view of it that does not) computed now."""
    sums = getattr(layer, "sums", {})
    if name in sums and sums[name].shape[:2] == layer.keys.shape[:2]:
        return sums[name]
    return _live_sum(name, layer.keys, layer.values, layer.live())


def _live_sum(name: str, keys: torch.Tensor, values: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Sum of ``KV_SUMS[name]`` over the tokens where ``live`` [B, H_kv, S] is True: [B, H_kv, D]."""
    return (KV_SUMS[name](keys, values) * live[..., None]).sum(dim=2, dtype=torch.float64)


def kv_field(layer, name: str) -> torch.Tensor:
    """[B, H_kv, capacity] per-token statistic ``name`` of ``KV_FIELDS``: the layer's stored one
    when it tracks it (built for a scorer listing it in ``kv_fields``), else computed now."""
    if name in layer.meta:
        return layer.meta[name]
    return KV_FIELDS[name](layer.keys, layer.values)


@dataclass(eq=False)  # hashed by identity: a scorer's host table may key on a view (LagKV's DueTable)
class LayerView:
    """What a scorer or an analysis reads of one layer: its tensors, per-token state and recent
    queries (``SieveLayer.view``).  A wrapper scoring a reshaped layer (CAOTE's query heads, AMS's
    kv heads as rows) builds one with ``dataclasses.replace``; an unreplaced ``meta`` is the
    layer's own dict, so per-token state written through the view reaches the layer."""

    keys: torch.Tensor  # [B, H_kv, capacity, D]
    values: torch.Tensor | None  # [B, H_kv, capacity, D_v]; None where not read (vLLM's worker: ``Needs.reads_values``)
    lengths: torch.Tensor  # [B, H_kv]
    meta: dict[str, torch.Tensor]  # "pos" and per-token state, [B, H_kv, capacity] each
    sums: dict[str, torch.Tensor]  # running sums (KV_SUMS), [B, H_kv, D]; {} where not kept
    recent_queries: torch.Tensor | None  # [B, H_q, w, D]
    recent_query_pos: torch.Tensor | None  # [B, w]
    scaling: float | None
    step_results: dict[str, Any]
    layer_idx: int
    max_len: int
    sliding_window: int | None = None  # the layer's attention window (a sliding-window layer)
    prompt_len: torch.Tensor | None = None  # [B] each row's prompt when the policy keeps it (SieveCache.set_prompt)

    def live(self) -> torch.Tensor:
        """[B, H_kv, capacity] bool: slots holding a real token."""
        return self.meta["pos"] != DEAD_POS

    def view(self) -> "LayerView":
        return self

    def repeat_heads(self, group: int) -> "LayerView":
        """Each kv head repeated ``group`` times along the head dimension (a query head's view)."""
        def rep(t):
            return None if t is None else t.repeat_interleave(group, dim=1)

        return dataclasses.replace(self, keys=rep(self.keys), values=rep(self.values), lengths=rep(self.lengths),
                                   meta={name: rep(t) for name, t in self.meta.items()}, sums={})

    def heads_as_rows(self) -> "LayerView":
        """Every (row, kv head) as its own row of one kv head: [B * H_kv, 1, ...]."""
        B, H, cap, D = self.keys.shape
        queries, qpos = self.recent_queries, self.recent_query_pos
        if queries is not None:
            queries = queries.reshape(B * H, queries.shape[1] // H, *queries.shape[2:])
            qpos = qpos.repeat_interleave(H, dim=0)
        values = None if self.values is None else self.values.reshape(B * H, 1, cap, -1)
        return dataclasses.replace(
            self, keys=self.keys.reshape(B * H, 1, cap, D), values=values,
            lengths=self.lengths.reshape(B * H, 1), meta={name: t.reshape(B * H, 1, cap) for name, t in self.meta.items()},
            sums={}, recent_queries=queries, recent_query_pos=qpos,
            prompt_len=None if self.prompt_len is None else self.prompt_len.repeat_interleave(H))

    def last_queries(self, window: int) -> "LayerView":
        """Only the newest ``window`` recent queries."""
        if self.recent_queries is None:
            return self
        drop = self.recent_queries.shape[2] - min(window, self.recent_queries.shape[2])
        return dataclasses.replace(self, recent_queries=self.recent_queries[:, :, drop:],
                                   recent_query_pos=self.recent_query_pos[:, drop:])


class SieveLayer(CacheLayerMixin):
    """One decoder layer's ragged KV store (see the module docstring for the layout)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, meta_init: dict[str, float] | None = None, grow_chunk: int = 256,
                 kv_fields: tuple[str, ...] = (), kv_sums: tuple[str, ...] = (), *,
                 capacity_hint: int | None = None, query_window: int = 0, static: bool = False,
                 layer_idx: int = 0):
        super().__init__()
        # Per-token state a policy asked for, with the value new tokens start with.
        self.meta_init = dict(meta_init or {})
        unknown = sorted(set(kv_fields) - set(KV_FIELDS))
        if unknown:
            raise ValueError(f"unknown per-token K/V fields {unknown}; known: {sorted(KV_FIELDS)}")
        self.kv_fields = tuple(kv_fields)  # per-token K/V statistics computed at append (KV_FIELDS)
        unknown = sorted(set(kv_sums) - set(KV_SUMS))
        if unknown:
            raise ValueError(f"unknown K/V running sums {unknown}; known: {sorted(KV_SUMS)}")
        self.kv_sums = tuple(kv_sums)
        self.sums: dict[str, torch.Tensor] = {}  # name -> [B, H_kv, D] float64 (KV_SUMS)
        self.layer_idx = layer_idx  # the decoder layer this store belongs to
        self.grow_chunk = grow_chunk
        # Capacity a bounded policy never needs to exceed (budget + compression interval):
        # growth stops there instead of overshooting by a whole grow_chunk.
        self.capacity_hint = capacity_hint
        self.lengths: torch.Tensor | None = None
        self.meta: dict[str, torch.Tensor] = {}
        self.capacity = 0
        self.max_len = 0
        # Recent post-RoPE queries, kept only when a policy asks for a query window.
        self.query_window = query_window
        self.recent_queries: torch.Tensor | None = None  # [B, H_q, w, D]
        self.recent_query_pos: torch.Tensor | None = None  # [B, w]
        self._query_buf: torch.Tensor | None = None  # [B, H_q, 2w, D]: the window is a view into it
        self._query_pos_buf: torch.Tensor | None = None  # [B, 2w]
        self._query_end = 0  # host int: entries of the buffer in use
        self.scaling: float | None = None  # the attention module's softmax scale, set on first use
        self.sliding_window: int | None = None  # its attention window (a sliding-window layer), set with scaling
        # [B] each row's prompt length, set by SieveCache.set_prompt when the policy keeps the prompt
        # (protected or pinned): a scorer may tell prompt from generated tokens by it (TriAttention's z-score)
        self.prompt_len: torch.Tensor | None = None
        # What this step's attention pass computed for the scorer while V was still in the CPU's
        # cache, for the compression after the step (CAOTE's "value_mix"); valid until the store
        # changes: cleared by update, compact, evict and select_rows
        self.step_results: dict[str, Any] = {}
        # Static mode (GenerateConfig.static_shapes): every tensor keeps its address between
        # reallocations (a compaction to the same capacity copies back in place, the query window
        # is a fixed ring), so a compiled decode step sees the same shapes every step.
        self.static = static

    # ------------------------------------------------------------------ allocation
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(B, H, 0, D)
        self.values = value_states.new_zeros(B, H, 0, value_states.shape[-1])
        self.lengths = torch.zeros(B, H, dtype=torch.long, device=self.device)
        self.meta = {"pos": torch.full((B, H, 0), DEAD_POS, dtype=torch.long, device=self.device)}
        for name in (*self.meta_init, *self.kv_fields):
            self.meta[name] = torch.zeros(B, H, 0, dtype=torch.float32, device=self.device)
        self.sums = {name: _live_sum(name, self.keys, self.values, self.lengths.new_zeros(B, H, 0, dtype=torch.bool))
                     for name in self.kv_sums}
        self.is_initialized = True

    def _fill_value(self, name: str) -> float:
        if name == "pos":
            return DEAD_POS
        return self.meta_init[name] if name in self.meta_init else 0.0

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` slots per head, growing by at least ``grow_chunk``."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, self.capacity + self.grow_chunk)
        if self.capacity_hint is not None:
            # within the hint: up to it; past it (a prompt longer than budget + interval, until its
            # compression): exactly what is needed, never a whole grow_chunk more
            new_cap = min(new_cap, self.capacity_hint) if needed <= self.capacity_hint else needed
        extra = new_cap - self.capacity
        B, H, _, D = self.keys.shape
        self.keys = torch.cat([self.keys, self.keys.new_zeros(B, H, extra, D)], dim=2)
        self.values = torch.cat([self.values, self.values.new_zeros(B, H, extra, self.values.shape[-1])], dim=2)
        for name, t in self.meta.items():
            self.meta[name] = torch.cat([t, t.new_full((B, H, extra), self._fill_value(name))], dim=2)
        self.capacity = new_cap

    # ------------------------------------------------------------------ writes
    def update(self, key_states, value_states, new_pos: torch.Tensor | None = None, *args, **kwargs):
        """``append`` with its host bookkeeping: make room first, count the tokens after.

        key_states, value_states: [B, H_kv, T, D];  new_pos: [B, T] (DEAD_POS for padding).
        Returns the whole store, ``[B, H_kv, capacity, D]`` each; attention masks dead slots.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.reserve(self.max_len + key_states.shape[2])
        out = self.append(key_states, value_states, new_pos)
        self.max_len += key_states.shape[2]
        return out

    def append(self, key_states, value_states, new_pos: torch.Tensor | None = None):
        """Write ``T`` new tokens per (row, head) after each head's live slots: device work only.

        It reads and writes no host state (room must have been made with ``reserve`` and
        ``max_len`` is advanced by the caller), so a compiled decode step can contain it.
        """
        if not self.is_initialized:
            raise RuntimeError("SieveLayer.append before the layer holds anything: prefill through update()")
        if new_pos is None:
            raise RuntimeError("SieveCache.update needs token positions: call cache.begin_step(query_pos) first")
        B, H, T, _ = key_states.shape
        self.step_results.clear()
        slot = self.lengths[:, :, None] + torch.arange(T, device=self.device)  # [B, H, T]
        key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        write_slots(self.keys, slot, key_states)
        write_slots(self.values, slot, value_states)
        write_slots(self.meta["pos"], slot, new_pos[:, None, :].expand(B, H, T))
        for name, init in self.meta_init.items():
            write_slots(self.meta[name], slot, init)
        for name in self.kv_fields:  # from the stored (cast) K/V, so they equal a recomputation
            write_slots(self.meta[name], slot, KV_FIELDS[name](key_states, value_states))
        if self.kv_sums:
            real = (new_pos != DEAD_POS)[:, None, :].expand(B, H, T)  # padding adds nothing
            for name in self.kv_sums:
                self.sums[name].add_(_live_sum(name, key_states, value_states, real))
        self.lengths += T
        return self.keys, self.values

    def begin_attention(self, query: torch.Tensor, query_pos: torch.Tensor, scaling: float,
                        sliding_window: int | None) -> None:
        """The attention function is about to read this layer: its softmax scale and window (a
        sliding-window layer), and the queries [B, H_q, T, D] at ``query_pos`` [B, T] to remember."""
        self.scaling, self.sliding_window = scaling, sliding_window
        self.remember_queries(query, query_pos)

    def keep_step_result(self, name: str, value: Any) -> None:
        """What this step's attention pass computed for the scorer (``step_results[name]``)."""
        self.step_results[name] = value

    def set_max_len(self, max_len: int) -> None:
        """A new host-side bound on the lengths, after an in-place eviction inside a compiled step
        (which cannot change host state): the schedule sets it after the step."""
        self.max_len = max_len

    def set_capacity_hint(self, hint: int) -> None:
        """The capacity the schedule plans never to exceed (budget + interval, + the prompt when it
        is protected): growth stops there."""
        self.capacity_hint = hint

    def remember_queries(self, query: torch.Tensor, query_pos: torch.Tensor) -> None:
        """Keep the last ``query_window`` post-RoPE queries ([B, H_q, T, D]) and their positions."""
        if self.query_window <= 0:
            return
        if self.static:
            self._remember_in_place(query, query_pos)
            return
        # A buffer of 2w slots filled left to right: recent_queries is a view of its last w
        # entries, and only when the buffer is full are those moved to the front (one copy of
        # the window every ~w steps instead of every step).
        w = self.query_window
        B, Hq, T, D = query.shape
        buf = self._query_buf
        if buf is None or buf.shape != (B, Hq, 2 * w, D) or buf.dtype != query.dtype:
            buf = self._query_buf = query.new_zeros(B, Hq, 2 * w, D)
            self._query_pos_buf = query_pos.new_full((B, 2 * w), DEAD_POS)
            self._query_end = 0
        if T >= w:
            query, query_pos, T, self._query_end = query[:, :, -w:], query_pos[:, -w:], w, 0
        elif self._query_end + T > 2 * w:  # full: move the last w - T entries to the front
            kept = min(w - T, self._query_end)
            start = self._query_end - kept
            buf[:, :, :kept] = buf[:, :, start:self._query_end].clone()
            self._query_pos_buf[:, :kept] = self._query_pos_buf[:, start:self._query_end].clone()
            self._query_end = kept
        end = self._query_end + T
        buf[:, :, self._query_end:end] = query
        self._query_pos_buf[:, self._query_end:end] = query_pos
        self._query_end = end
        self._window_views()

    def _window_views(self) -> None:
        """Point recent_queries / recent_query_pos at the last w entries of the query buffer."""
        start = max(0, self._query_end - self.query_window)
        self.recent_queries = self._query_buf[:, :, start:self._query_end]
        self.recent_query_pos = self._query_pos_buf[:, start:self._query_end]

    def _remember_in_place(self, query: torch.Tensor, query_pos: torch.Tensor) -> None:
        """Static mode: a window of fixed size and address, oldest first; unfilled entries are
        padding queries (position DEAD_POS), which window attention gives zero rows."""
        B, Hq, T, D = query.shape
        w = self.query_window
        if self.recent_queries is None or self.recent_queries.shape[0] != B:
            self.recent_queries = query.new_zeros(B, Hq, w, D)
            self.recent_query_pos = query_pos.new_full((B, w), DEAD_POS)
        self.recent_queries.copy_(torch.cat([self.recent_queries, query], dim=2)[:, :, -w:])
        self.recent_query_pos.copy_(torch.cat([self.recent_query_pos, query_pos], dim=1)[:, -w:])

    # ------------------------------------------------------------------ eviction
    def compact(self, kept_idx: torch.Tensor, new_lengths: torch.Tensor, capacity: int, max_len: int) -> None:
        """Keep the slots ``kept_idx`` ([B, H_kv, K], live ones first) with one gather per tensor.

        ``new_lengths`` [B, H_kv] says how many leading entries of ``kept_idx`` are live;
        the store is reallocated at ``capacity >= K`` slots (room for the appends before the
        next compaction) and slots past each head's length are marked dead.
        """
        B, H, K = kept_idx.shape
        if capacity < K:
            raise ValueError(f"compact: capacity {capacity} < kept slots {K}")
        self.step_results.clear()
        if capacity > K:
            kept_idx = torch.cat([kept_idx, kept_idx.new_zeros(B, H, capacity - K)], dim=2)
        dead = torch.arange(capacity, device=self.device) >= new_lengths[..., None]  # [B, H, capacity]
        keys, values = read_slots(self.keys, kept_idx), read_slots(self.values, kept_idx)
        meta = {name: read_slots(t, kept_idx).masked_fill(dead, self._fill_value(name)) for name, t in self.meta.items()}
        if self.static and capacity == self.capacity:  # same shapes: keep every address
            for old, new in zip((self.keys, self.values, self.lengths, *self.meta.values()),
                                (keys, values, new_lengths, *meta.values())):
                old.copy_(new)
        else:
            self.keys, self.values, self.meta = keys, values, meta
            self.lengths = new_lengths.clone()
        for name, total in self.sums.items():  # recounted from the kept tokens (no drift carried over)
            total.copy_(_live_sum(name, self.keys, self.values, self.live()))
        self.capacity = capacity
        self.max_len = max_len

    def evict(self, drop_idx: torch.Tensor, drop_count: torch.Tensor, max_len: int | None = None) -> None:
        """Drop a few live slots per (row, head) in place, without reallocating.

        ``drop_idx`` [B, H_kv, m]: candidate slots, of which the first ``drop_count`` [B, H_kv]
        (<= m) are dropped; they must be distinct live slots.  The live tokens of the tail
        (slots ``length - drop_count`` .. ``length - 1``) that are not dropped move into the
        holes below the new length, so live slots stay ``0 .. length - 1``.  Costs O(m) token
        copies per head instead of ``compact``'s O(capacity).  ``max_len`` is the new host-side
        bound on the lengths (None: the caller sets it, as a compiled step does after the call).
        """
        m = drop_idx.shape[-1]
        self.step_results.clear()
        if m == 1:  # every-step eviction: about half the operations of the general case
            self._evict_one(drop_idx, drop_count, max_len)
            return
        step = torch.arange(m, device=self.device)
        new_len = self.lengths - drop_count  # [B, H]
        dropped = step < drop_count[..., None]  # [B, H, m]: which candidates really go
        self._subtract_sums(drop_idx, dropped)
        tail = new_len[..., None] + step  # [B, H, m]: the slots that fall off the new end
        tail_dropped = ((tail[..., :, None] == drop_idx[..., None, :]) & dropped[..., None, :]).any(dim=-1)
        movers = dropped & ~tail_dropped  # tail tokens that stay (as many as there are holes)
        holes = dropped & (drop_idx < new_len[..., None])
        far = self.capacity  # sorts after every real slot
        dst = torch.where(holes, drop_idx, far).sort(dim=-1).values
        src = torch.where(movers, tail, far).sort(dim=-1).values
        # unused pairs copy a slot past the new end onto itself (never a real destination)
        idle = torch.clamp(tail, max=self.capacity - 1)
        self._move_slots(src=torch.where(src == far, idle, src), dst=torch.where(dst == far, idle, dst))
        dead = torch.arange(self.capacity, device=self.device) >= new_len[..., None]  # [B, H, capacity]
        for name, t in self.meta.items():
            t.masked_fill_(dead, self._fill_value(name))
        self.lengths.copy_(new_len)
        if max_len is not None:
            self.max_len = max_len

    def _evict_one(self, drop_idx: torch.Tensor, drop_count: torch.Tensor, max_len: int | None) -> None:
        """``evict`` with m = 1: the last live token moves into the dropped slot (a self-copy
        when it is the dropped one, or when nothing goes: drop_count 0)."""
        drop = drop_count[..., None]  # [B, H, 1], 0 or 1
        self._subtract_sums(drop_idx, drop > 0)
        vacated = self.lengths[..., None] - drop  # the new end: a dead slot when nothing goes
        self._move_slots(src=torch.where(drop > 0, vacated, drop_idx), dst=drop_idx)
        for name, t in self.meta.items():
            write_slots(t, vacated, self._fill_value(name))
        self.lengths.sub_(drop_count)
        if max_len is not None:
            self.max_len = max_len

    def _subtract_sums(self, drop_idx: torch.Tensor, dropped: torch.Tensor) -> None:
        """Take the tokens in slots ``drop_idx`` [B, H_kv, m] where ``dropped`` out of the running sums."""
        if not self.sums:
            return
        dropped = dropped & (read_slots(self.meta["pos"], drop_idx) != DEAD_POS)  # only live tokens were added
        keys, values = read_slots(self.keys, drop_idx), read_slots(self.values, drop_idx)
        for name, total in self.sums.items():
            total.sub_(_live_sum(name, keys, values, dropped))

    def _move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the token in slot ``src`` to slot ``dst`` ([B, H_kv, m] each) in K, V and every
        per-token field, in place (all sources are read before any destination is written)."""
        for t in (self.keys, self.values, *self.meta.values()):
            write_slots(t, dst, read_slots(t, src))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (finished rows leave the batch and free their memory)."""
        if not self.is_initialized:
            return
        self.keys, self.values = self.keys[rows], self.values[rows]
        self.step_results.clear()
        self.lengths = self.lengths[rows]
        self.meta = {name: t[rows] for name, t in self.meta.items()}
        self.sums = {name: t[rows] for name, t in self.sums.items()}
        if self._query_buf is not None and not self.static:
            self._query_buf, self._query_pos_buf = self._query_buf[rows], self._query_pos_buf[rows]
            self._window_views()
        elif self.recent_queries is not None:
            self.recent_queries, self.recent_query_pos = self.recent_queries[rows], self.recent_query_pos[rows]

    # ------------------------------------------------------------------ accounting
    def storage(self) -> tuple:
        """Addresses and shapes a captured step depends on; any change needs a new capture."""
        if not self.is_initialized:
            return ()
        tensors = [self.keys, self.values, self.lengths, *self.meta.values(), *self.sums.values()]
        if self.recent_queries is not None:
            tensors += [self.recent_queries, self.recent_query_pos]
        return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)

    def live(self) -> torch.Tensor:
        """[B, H_kv, capacity] bool: slots holding a real token."""
        return self.meta["pos"] != DEAD_POS

    def view(self) -> LayerView:
        """This layer as scorers and analyses read it (shares its tensors and dicts)."""
        return LayerView(self.keys, self.values, self.lengths, self.meta, self.sums, self.recent_queries,
                         self.recent_query_pos, self.scaling, self.step_results, self.layer_idx, self.max_len,
                         self.sliding_window, self.prompt_len)

    def allocated_bytes(self) -> int:
        """Bytes this layer holds right now: K, V, every per-token metadata tensor and running sum."""
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, *self.meta.values(), *self.sums.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def get_seq_length(self) -> int:
        return self.max_len

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity + query_length, 0


# What serves ``SieveCache.for_model``: ``kvsieve.hf`` registers it when imported (``import
# kvsieve`` does), so the core cache knows neither the methods nor transformers' generate loop.
_FOR_MODEL: list[Callable[..., "SieveCache"]] = []


def serve_for_model(factory: Callable[..., "SieveCache"]) -> None:
    """Register the function behind ``SieveCache.for_model`` (called by ``kvsieve.hf``)."""
    _FOR_MODEL[:] = [factory]


class SieveCache(Cache):
    """A cache of ``SieveLayer`` objects plus each row's true position.

    ``seen_tokens`` [B] counts the real tokens each row has seen, so the next token's
    position is ``seen_tokens`` whatever the cache lengths are after eviction.  Call
    ``begin_step(query_pos)`` before every forward pass: it tells the layers the positions of
    the tokens they are about to append.

    It is the transformers engine's store (``kvsieve.engine.Store``): the schedule
    (``kvsieve.schedule``) decides what it keeps and builds it from plain numbers
    (``schedule.store_settings``); it never sees the policy.

    A ``managed`` cache (the one a ``kvsieve.session.DecodeSession`` owns) leaves the host
    bookkeeping to its owner: ``prepare(T)`` before the forward pass (room for T tokens) and
    ``advance(T)`` after it (the host-side lengths bound), so ``update`` is device work only
    and a compiled step can contain it.  Otherwise ``update`` does both itself.
    """

    def __init__(self, num_layers: int, meta_init: dict[str, float] | None = None, grow_chunk: int = 256,
                 kv_fields: tuple[str, ...] = (), kv_sums: tuple[str, ...] = (), *,
                 capacity_hints: list[int | None] | None = None, query_window: int = 0, static: bool = False,
                 managed: bool = False):
        hints = capacity_hints or [None] * num_layers
        super().__init__(layers=[SieveLayer(meta_init, grow_chunk, kv_fields, kv_sums, capacity_hint=hint,
                                            query_window=query_window, static=static, layer_idx=index)
                                 for index, hint in enumerate(hints)])
        self.seen_tokens: torch.Tensor | None = None  # [B]
        # [B] prompt tokens of each row, set at the end of prefill (``set_prompt``) for a policy that
        # keeps the prompt (``Policy.protect_prompt`` or ``pin_prompt``); ``prompt_max`` is a host-side upper bound
        # on it (the longest prompt when set; rows leaving the batch never lower it)
        self.prompt_len: torch.Tensor | None = None
        self.prompt_max = 0
        self.query_pos: torch.Tensor | None = None  # [B, T] positions of the tokens in flight
        self.managed = managed

    @classmethod
    def for_model(cls, model, method: str = "full", budget: int | None = None, *, horizon: int | None = None,
                  tokenizer=None, **settings) -> "SieveCache":
        """A cache for transformers' own ``model.generate(..., cache=cache)`` (or
        ``past_key_values=cache``) that compresses like ``kvsieve.generate`` with ``method`` at
        ``budget`` (``settings`` as in ``make_policy``, or ``policy=`` a ready one).  It switches
        ``model`` to kvsieve's attention and serves one call; ``horizon`` (prompt + new tokens) is
        needed only by methods that size themselves to the row (LagKV).  ``kvsieve.hf`` builds it
        (a ``ScheduledCache``, which holds the schedule): this class never sees the policy."""
        if not _FOR_MODEL:
            raise RuntimeError("SieveCache.for_model is served by kvsieve.hf: import kvsieve (or kvsieve.hf) first")
        return _FOR_MODEL[0](model, method, budget, horizon=horizon, tokenizer=tokenizer, **settings)

    def prepare(self, T: int) -> bool:
        """Make room for ``T`` more tokens in every layer (host-side); True if any layer grew."""
        grew = False
        for layer in self.layers:
            if layer.is_initialized and layer.max_len + T > layer.capacity:
                layer.reserve(layer.max_len + T)
                grew = True
        return grew

    def advance(self, T: int) -> None:
        """Count ``T`` appended tokens in every layer's host-side bound ``max_len``."""
        for layer in self.layers:
            layer.max_len += T

    def begin_step(self, query_pos: torch.Tensor) -> None:
        self.query_pos = query_pos

    def set_seen(self, seen_tokens: torch.Tensor) -> None:
        """Every row has seen ``seen_tokens`` [B] real tokens (its next token's position)."""
        self.seen_tokens = seen_tokens

    def count_decoded(self) -> None:
        """One more token seen by every row (a decode step; in place, so a compiled step can do it)."""
        self.seen_tokens.add_(1)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if not self.managed:
            return layer.update(key_states, value_states, self.query_pos)
        if not layer.is_initialized:  # the first prefill chunk allocates (host work anyway); the owner advances
            layer.lazy_initialization(key_states, value_states)
            layer.reserve(key_states.shape[2])
        return layer.append(key_states, value_states, self.query_pos)

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_rows(rows)
        self.seen_tokens = self.seen_tokens[rows]
        if self.prompt_len is not None:
            self._share_prompt(self.prompt_len[rows])

    def set_prompt(self, prompt_len: torch.Tensor) -> None:
        """Record each row's prompt length [B] (one host read, for ``prompt_max``); every layer
        reads it too (``SieveLayer.prompt_len``)."""
        self._share_prompt(prompt_len.clone())
        self.prompt_max = int(prompt_len.max()) if prompt_len.numel() else 0

    def _share_prompt(self, prompt_len: torch.Tensor) -> None:
        self.prompt_len = prompt_len
        for layer in self.layers:
            layer.prompt_len = prompt_len

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def live_tokens(self) -> torch.Tensor:
        """[B, L] live tokens per row and layer, summed over kv heads (a device tensor)."""
        return torch.stack([layer.live().sum(dim=(1, 2)) for layer in self.layers], dim=1)
