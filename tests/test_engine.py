"""A second store behind the schedule (issue 48): a plain dense tensor store in a few lines.

``kvsieve.engine`` writes down what the schedule asks of a store: a read-only view for scoring,
and keep-sets applied by gather (``compact``) or in place (``evict``).  ``DenseStore`` below
implements it without anything ``SieveCache`` adds for speed (no running sums, no fixed
addresses, no ring buffer, in-place eviction done as a gather), and the bundled model decodes
the same greedy tokens on it as on ``SieveCache`` for every method that evicts in place.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvsieve.cache import DEAD_POS, KV_FIELDS, LayerView, SieveCache
from kvsieve.engine import Store, StoreLayer
from kvsieve.generate import left_pad
from kvsieve.methods import SCORERS, make_policy, method_names
from kvsieve.session import DecodeSession

PROMPTS = ["A farmer has 17 sheep and buys 5 more each week. How many sheep does he have after six weeks?",
           "List three prime numbers."]
NEW_TOKENS = 32
BUDGETS = (24, 48)  # below the longer prompt (its compression, then in place) and above it
SETTINGS = {"lazy": {"window": 8}}  # lazy refuses a budget below 2W (W = 25 by default)


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Slots ``idx`` [B, H, K] of a [B, H, S] or [B, H, S, D] tensor."""
    return t.gather(2, idx[..., None].expand(*idx.shape, t.shape[-1]) if t.dim() == 4 else idx)


class DenseLayer(CacheLayerMixin):
    """One layer: K, V and per-token fields as dense [B, H_kv, capacity, ...] tensors."""

    is_compileable = False
    is_sliding = False

    def __init__(self, layer_idx: int, meta_init: dict, kv_fields: tuple, query_window: int, hint, grow_chunk: int):
        super().__init__()
        self.layer_idx, self.meta_init, self.kv_fields, self.query_window = layer_idx, meta_init, kv_fields, query_window
        self.capacity_hint, self.grow_chunk = hint, grow_chunk
        self.capacity = self.max_len = 0
        self.sums, self.step_results = {}, {}  # no running sums: scorers compute them (cache.kv_sum)
        self.recent_queries = self.recent_query_pos = self.scaling = self.sliding_window = self.prompt_len = None

    def fill(self, name: str) -> float:
        return DEAD_POS if name == "pos" else self.meta_init.get(name, 0.0)

    def lazy_initialization(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        B, H = keys.shape[:2]
        self.keys, self.values = keys[:, :, :0], values[:, :, :0]
        self.lengths = torch.zeros(B, H, dtype=torch.long)
        self.meta = {name: torch.zeros(B, H, 0, dtype=torch.long if name == "pos" else torch.float32)
                     for name in ("pos", *self.meta_init, *self.kv_fields)}
        self.is_initialized = True

    # ------------------------------------------------------------------ what the schedule calls (engine.StoreLayer)
    def live(self) -> torch.Tensor:
        return self.meta["pos"] != DEAD_POS

    def view(self) -> LayerView:
        return LayerView(self.keys, self.values, self.lengths, self.meta, self.sums, self.recent_queries,
                         self.recent_query_pos, self.scaling, self.step_results, self.layer_idx, self.max_len,
                         self.sliding_window, self.prompt_len)

    def compact(self, kept_idx, new_lengths, capacity, max_len) -> None:
        B, H, K = kept_idx.shape
        idx = torch.cat([kept_idx, kept_idx.new_zeros(B, H, capacity - K)], dim=2)
        dead = torch.arange(capacity) >= new_lengths[..., None]
        self.keys, self.values = _gather(self.keys, idx), _gather(self.values, idx)
        self.meta = {name: _gather(t, idx).masked_fill(dead, self.fill(name)) for name, t in self.meta.items()}
        self.lengths, self.capacity, self.max_len = new_lengths.clone(), capacity, max_len
        self.step_results.clear()

    def evict(self, drop_idx, drop_count, max_len=None) -> None:
        """In place, as a gather: the surviving tail tokens fill the holes, lowest to lowest."""
        S = self.capacity
        slot = torch.arange(S)
        dropped = torch.zeros_like(self.live()).scatter_(2, drop_idx, torch.arange(drop_idx.shape[-1]) < drop_count[..., None])
        new_len = self.lengths - drop_count
        holes = torch.where(dropped & (slot < new_len[..., None]), slot, S).sort(dim=-1).values
        movers = torch.where(~dropped & (slot >= new_len[..., None]) & (slot < self.lengths[..., None]), slot, S)
        order = torch.cat([slot.expand_as(dropped), slot.new_full(dropped.shape[:2] + (1,), S)], dim=2)
        order = order.scatter(2, holes, movers.sort(dim=-1).values)[..., :S]  # unused pairs land on slot S
        self.compact(order, new_len, S, self.max_len if max_len is None else max_len)

    def set_max_len(self, max_len: int) -> None:
        self.max_len = max_len

    def set_capacity_hint(self, hint: int) -> None:
        self.capacity_hint = hint

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` slots: at least ``grow_chunk`` more, up to the schedule's hint."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, self.capacity + self.grow_chunk)
        if self.capacity_hint is not None:
            new_cap = min(new_cap, self.capacity_hint) if needed <= self.capacity_hint else needed
        def grown(t: torch.Tensor, fill) -> torch.Tensor:
            return torch.cat([t, t.new_full((*t.shape[:2], new_cap - self.capacity, *t.shape[3:]), fill)], dim=2)

        self.keys, self.values = grown(self.keys, 0), grown(self.values, 0)
        self.meta = {name: grown(t, self.fill(name)) for name, t in self.meta.items()}
        self.capacity = new_cap

    # ------------------------------------------------------------------ what the attention function calls
    def begin_attention(self, query, query_pos, scaling, sliding_window) -> None:
        self.scaling, self.sliding_window = scaling, sliding_window
        if self.query_window:
            old = (self.recent_queries, self.recent_query_pos) if self.recent_queries is not None else (query[:, :, :0],
                                                                                                     query_pos[:, :0])
            self.recent_queries = torch.cat([old[0], query], dim=2)[:, :, -self.query_window:]
            self.recent_query_pos = torch.cat([old[1], query_pos], dim=1)[:, -self.query_window:]

    def keep_step_result(self, name, value) -> None:
        self.step_results[name] = value

    def append(self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor):
        B, H, T, _ = keys.shape
        slot = self.lengths[..., None] + torch.arange(T)  # [B, H, T]
        self.keys = self.keys.scatter(2, slot[..., None].expand(B, H, T, keys.shape[-1]), keys)
        self.values = self.values.scatter(2, slot[..., None].expand(B, H, T, values.shape[-1]), values)
        new = {"pos": pos[:, None].expand(B, H, T), **{name: torch.full((B, H, T), init) for name, init in
                                                        self.meta_init.items()},
               **{name: KV_FIELDS[name](keys, values) for name in self.kv_fields}}
        self.meta = {name: t.scatter(2, slot, new[name].to(t.dtype)) for name, t in self.meta.items()}
        self.lengths = self.lengths + T
        self.step_results.clear()
        return self.keys, self.values

    def update(self, *args, **kwargs):  # the store writes through ``append``
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return self.max_len

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity + query_length, 0


class DenseStore(Cache):
    """Every layer plus each row's seen tokens: the ``engine.Store`` a ``DecodeSession`` drives."""

    def __init__(self, num_layers, meta_init=None, grow_chunk=256, kv_fields=(), kv_sums=(), *, capacity_hints=None,
                 query_window=0, static=False, managed=True):
        hints = capacity_hints or [None] * num_layers
        super().__init__(layers=[DenseLayer(i, dict(meta_init or {}), tuple(kv_fields), query_window, hint, grow_chunk)
                                 for i, hint in enumerate(hints)])
        self.seen_tokens = self.prompt_len = self.query_pos = None
        self.prompt_max = 0

    def set_seen(self, seen_tokens) -> None:
        self.seen_tokens = seen_tokens

    def count_decoded(self) -> None:
        self.seen_tokens = self.seen_tokens + 1

    def set_prompt(self, prompt_len) -> None:
        self.prompt_len, self.prompt_max = prompt_len.clone(), int(prompt_len.max())
        for layer in self.layers:
            layer.prompt_len = self.prompt_len

    def begin_step(self, query_pos) -> None:
        self.query_pos = query_pos

    def prepare(self, T: int) -> bool:
        grow = [layer for layer in self.layers if layer.is_initialized and layer.max_len + T > layer.capacity]
        for layer in grow:
            layer.reserve(layer.max_len + T)
        return bool(grow)

    def advance(self, T: int) -> None:
        for layer in self.layers:
            layer.max_len += T

    def update(self, keys, values, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
            layer.reserve(keys.shape[2])
        return layer.append(keys, values, self.query_pos)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values, *layer.meta.values()))

    def live_tokens(self) -> torch.Tensor:
        return torch.stack([layer.live().sum(dim=(1, 2)) for layer in self.layers], dim=1)


def in_place_methods() -> list[str]:
    """Every method whose scorer lets the schedule evict in place (``Needs.slot_order_free``), and
    the wrappers over tova; ``triattention`` needs a calibration file (``stats=``) and is left out."""
    names = [n for n in method_names()[1:] if SCORERS[n].needs.uses_budget and n != "triattention"]
    return [n for n in names + ["caote:tova", "fastcaote:tova"] if make_policy(n, 64).scorer.needs.slot_order_free]


def greedy(model, tok, policy, store) -> list[list[int]]:
    """NEW_TOKENS greedy tokens per prompt, decoded by a DecodeSession on ``store``."""
    input_ids, positions = left_pad([tok(p).input_ids for p in PROMPTS], tok.pad_token_id or 0, model.device)
    session = DecodeSession(model, policy, batch_size=len(PROMPTS), horizon=input_ids.shape[1] + NEW_TOKENS,
                            store=store)
    out = []
    with session.attached(tok):
        token = session.prefill(input_ids, positions).argmax(dim=-1)
        for _ in range(NEW_TOKENS):
            out.append(token)
            token = session.step(token).argmax(dim=-1)
    return torch.stack(out, dim=1).tolist()


def test_the_stores_implement_the_engine_protocol():
    for store in (SieveCache(2, capacity_hints=[8, None]), DenseStore(2, capacity_hints=[8, None])):
        for name in ("set_seen", "set_prompt", "layers", "prompt_max"):
            assert hasattr(store, name), name
        for name in ("compact", "evict", "set_max_len", "set_capacity_hint", "reserve", "live", "view", "capacity"):
            assert hasattr(store.layers[0], name), name
        assert store.layers[0].capacity_hint == 8 and store.layers[1].layer_idx == 1
    assert {"compact", "evict"} <= set(dir(StoreLayer)) and "set_seen" in dir(Store)


DEFAULT = {"tova", "h2o", "caote:tova"}


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow)
                                  for n in in_place_methods()])
def test_a_dense_store_decodes_the_same_tokens_as_sieve_cache(smollm, name, budget):
    """The schedule hands both stores the same keep-sets, so they hold the same tokens in the same
    slots and decode the same greedy tokens, in place and by gather alike."""
    model, tok = smollm
    policy = make_policy(name, budget, **SETTINGS.get(name, {}))
    ours = greedy(model, tok, policy, SieveCache)
    assert greedy(model, tok, policy, DenseStore) == ours
    assert len(ours[0]) == NEW_TOKENS
