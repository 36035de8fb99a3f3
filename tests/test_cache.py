"""Tests for kvsieve.cache: the ragged, compactable per-(row, kv head) KV store.

Every check compares the store against an independent Python model of what each
(row, kv head) should hold: a list of (position, key, value, meta) in slot order.
No model is loaded; all tensors are small and seeded.
"""

from __future__ import annotations

import pytest
import torch

from kvsieve.cache import DEAD_POS, KV_FIELDS, KV_SUMS, SieveCache, SieveLayer, kv_field, kv_sum
from kvsieve.schedule import indices_from_mask, scorer_fields

B, H, D, DV = 2, 3, 4, 5


def rand(g: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def append(cache: SieveCache, model, g, pos_rows: list[list[int]], layer_idx: int = 0):
    """Append one token per entry of ``pos_rows[b]`` to every kv head; mirror it in ``model``."""
    T = len(pos_rows[0])
    Bn, Hn = len(model), len(model[0])
    k, v = rand(g, Bn, Hn, T, D), rand(g, Bn, Hn, T, DV)
    pos = torch.tensor(pos_rows, dtype=torch.long)
    cache.begin_step(pos)
    cache.update(k, v, layer_idx)
    for b in range(Bn):
        for h in range(Hn):
            for t in range(T):
                model[b][h].append((pos_rows[b][t], k[b, h, t].clone(), v[b, h, t].clone()))
    return k, v


def assert_layer_matches(layer: SieveLayer, model) -> None:
    """Slots 0..len-1 of each (row, head) hold exactly the model's tokens; the rest are dead."""
    for b, row in enumerate(model):
        for h, toks in enumerate(row):
            n = len(toks)
            assert int(layer.lengths[b, h]) == n, (b, h)
            for s, (p, k, v) in enumerate(toks):
                assert int(layer.meta["pos"][b, h, s]) == p, (b, h, s)
                torch.testing.assert_close(layer.keys[b, h, s], k, rtol=0, atol=0)
                torch.testing.assert_close(layer.values[b, h, s], v, rtol=0, atol=0)
            assert (layer.meta["pos"][b, h, n:] == DEAD_POS).all(), (b, h)
    assert layer.max_len >= int(layer.lengths.max())


def compact_to(layer: SieveLayer, model, keep: torch.Tensor, headroom: int = 0):
    """Compact ``layer`` with keep mask [B, H, capacity] and mirror it in ``model``."""
    K = int(keep.sum(-1).max())
    kept_idx, new_lengths = indices_from_mask(keep, K)
    layer.compact(kept_idx, new_lengths, capacity=K + headroom, max_len=K)
    for b, row in enumerate(model):
        for h in range(len(row)):
            row[h] = [tok for s, tok in enumerate(row[h]) if bool(keep[b, h, s])]


def empty_model(Bn=B, Hn=H):
    return [[[] for _ in range(Hn)] for _ in range(Bn)]


# ---------------------------------------------------------------------------- appends


def test_append_after_ragged_compaction_lands_right_after_each_heads_live_slots():
    g = torch.Generator().manual_seed(0)
    cache = SieveCache(1, grow_chunk=4)
    layer = cache.layers[0]
    model = empty_model()
    append(cache, model, g, [list(range(6)), list(range(6))])
    assert_layer_matches(layer, model)

    # Compact every head to a different length (1 .. 6 live slots).
    counts = [[6, 3, 1], [2, 5, 4]]
    keep = torch.zeros(B, H, layer.capacity, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            chosen = torch.randperm(6, generator=g)[: counts[b][h]]
            keep[b, h, chosen] = True
    compact_to(layer, model, keep, headroom=2)
    assert layer.lengths.tolist() == counts
    assert_layer_matches(layer, model)

    # Append a 2-token chunk: each head's new tokens go to slots len, len+1 of that head.
    old_len = layer.lengths.clone()
    append(cache, model, g, [[6, 7], [6, 7]])
    assert torch.equal(layer.lengths, old_len + 2)
    assert_layer_matches(layer, model)
    for b in range(B):
        for h in range(H):
            assert layer.meta["pos"][b, h, old_len[b, h] : old_len[b, h] + 2].tolist() == [6, 7]

    # Compact again to other lengths, then append rows with different positions.
    keep = layer.live().clone()
    keep[0, 0, :3] = False
    keep[1, 2, 1] = False
    compact_to(layer, model, keep, headroom=1)
    append(cache, model, g, [[8], [8]])
    append(cache, model, g, [[9, 10, 11], [9, 10, 11]])  # needs to grow the store
    assert_layer_matches(layer, model)


def test_append_without_begin_step_is_rejected_with_a_hint():
    cache = SieveCache(1)
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.update(torch.zeros(1, 1, 1, D), torch.zeros(1, 1, 1, DV), 0)


def test_new_tokens_start_with_each_meta_fields_initial_value():
    g = torch.Generator().manual_seed(1)
    cache = SieveCache(1, meta_init={"acc": 0.0, "ts": 2.5}, grow_chunk=4)
    layer = cache.layers[0]
    model = empty_model()
    append(cache, model, g, [[0, 1, 2], [0, 1, 2]])
    layer.meta["acc"][:, :, :3] = 7.0
    layer.meta["ts"][:, :, :3] = -1.0
    append(cache, model, g, [[3], [3]])
    assert (layer.meta["acc"][:, :, :3] == 7.0).all() and (layer.meta["acc"][:, :, 3] == 0.0).all()
    assert (layer.meta["ts"][:, :, :3] == -1.0).all() and (layer.meta["ts"][:, :, 3] == 2.5).all()
    assert layer.meta["acc"].dtype == torch.float32 and layer.meta["pos"].dtype == torch.long


# ---------------------------------------------------------------------------- compaction


@pytest.mark.parametrize("seed", range(5))
def test_compact_equals_dense_gather_of_kept_slots_for_keys_values_and_meta(seed):
    g = torch.Generator().manual_seed(seed)
    Bn, Hn, S = 3, 2, 11
    cache = SieveCache(1, meta_init={"acc": 0.0}, grow_chunk=3)
    layer = cache.layers[0]
    keys, values = rand(g, Bn, Hn, S, D), rand(g, Bn, Hn, S, DV)
    # Row 2 is left padded (two dead slots with DEAD_POS at the front).
    pos = torch.tensor([list(range(S)), list(range(10, 10 + S)), [DEAD_POS] * 2 + list(range(S - 2))])
    cache.begin_step(pos)
    cache.update(keys, values, 0)
    acc = rand(g, Bn, Hn, layer.capacity)
    layer.meta["acc"] = acc.clone()
    pos_full = layer.meta["pos"].clone()

    keep = torch.rand(Bn, Hn, layer.capacity, generator=g) < 0.5
    keep[..., S:] = False  # never keep past the live slots
    keep[0, 1, :] = False  # one head loses everything
    keep[1, 0, :S] = True  # one head keeps everything
    K = int(keep.sum(-1).max())
    headroom = int(torch.randint(0, 4, (1,), generator=g))
    kept_idx, new_lengths = indices_from_mask(keep, K)
    layer.compact(kept_idx, new_lengths, capacity=K + headroom, max_len=K)

    assert layer.capacity == K + headroom == layer.keys.shape[2] == layer.values.shape[2]
    assert layer.max_len == K
    for b in range(Bn):
        for h in range(Hn):
            kept = [s for s in range(S) if keep[b, h, s]]
            n = len(kept)
            assert int(layer.lengths[b, h]) == n
            torch.testing.assert_close(layer.keys[b, h, :n], keys[b, h, kept], rtol=0, atol=0)
            torch.testing.assert_close(layer.values[b, h, :n], values[b, h, kept], rtol=0, atol=0)
            assert layer.meta["pos"][b, h, :n].tolist() == pos_full[b, h, kept].tolist()
            torch.testing.assert_close(layer.meta["acc"][b, h, :n], acc[b, h, kept], rtol=0, atol=0)
            # dead slots: DEAD_POS and the field's initial value
            assert (layer.meta["pos"][b, h, n:] == DEAD_POS).all()
            assert (layer.meta["acc"][b, h, n:] == 0.0).all()


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("seed", range(8))
def test_evict_in_place_keeps_the_same_tokens_as_a_dense_gather_without_reallocating(seed, m):
    """``evict`` drops drop_count[b, h] of the candidate slots; the survivors are exactly the
    dense gather's (as a set, with K/V/meta attached), packed into slots 0..len-1."""
    g = torch.Generator().manual_seed(seed)
    Bn, Hn, S = 2, 3, 12
    cache = SieveCache(1, meta_init={"acc": 0.0})
    layer = cache.layers[0]
    layer.capacity_hint = S + 2
    keys, values = rand(g, Bn, Hn, S, D), rand(g, Bn, Hn, S, DV)
    pos = torch.arange(S).repeat(Bn, 1)
    cache.begin_step(pos)
    cache.update(keys, values, 0)
    layer.meta["acc"][..., :S] = rand(g, Bn, Hn, S)
    before = {name: t.clone() for name, t in layer.meta.items()}
    drop_count = torch.randint(0, m + 1, (Bn, Hn), generator=g)
    drop_idx = torch.stack([torch.randperm(S, generator=g)[:m] for _ in range(Bn * Hn)]).view(Bn, Hn, m)
    drop_idx[0, 0] = torch.arange(S - m, S)  # all candidates in the tail: nothing moves
    drop_count[0, 0] = m
    storage = layer.keys.data_ptr()
    layer.evict(drop_idx, drop_count, max_len=S)

    assert layer.keys.data_ptr() == storage and layer.capacity == S + 2
    for b in range(Bn):
        for h in range(Hn):
            gone = set(drop_idx[b, h, : int(drop_count[b, h])].tolist())
            kept = [s for s in range(S) if s not in gone]
            n = len(kept)
            assert int(layer.lengths[b, h]) == n
            order = layer.meta["pos"][b, h, :n].argsort()  # position order is not promised
            assert layer.meta["pos"][b, h, :n][order].tolist() == kept
            torch.testing.assert_close(layer.keys[b, h, :n][order], keys[b, h, kept], rtol=0, atol=0)
            torch.testing.assert_close(layer.values[b, h, :n][order], values[b, h, kept], rtol=0, atol=0)
            torch.testing.assert_close(layer.meta["acc"][b, h, :n][order], before["acc"][b, h, kept])
            assert (layer.meta["pos"][b, h, n:] == DEAD_POS).all() and (layer.meta["acc"][b, h, n:] == 0).all()


def test_indices_from_mask_lists_kept_slots_in_slot_order_then_zeros():
    keep = torch.tensor([[[False, True, False, True, True], [True, False, False, False, False]]])
    kept_idx, lengths = indices_from_mask(keep, 3)
    assert kept_idx.tolist() == [[[1, 3, 4], [0, 0, 0]]]
    assert lengths.tolist() == [[3, 1]]


def test_compact_rejects_capacity_below_kept_slots():
    g = torch.Generator().manual_seed(0)
    cache = SieveCache(1)
    append(cache, empty_model(), g, [[0, 1, 2], [0, 1, 2]])
    kept_idx = torch.zeros(B, H, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="capacity 2 < kept slots 3"):
        cache.layers[0].compact(kept_idx, torch.full((B, H), 3), capacity=2, max_len=3)


# ---------------------------------------------------------------------------- memory


def expected_bytes(Bn, Hn, cap, n_float_meta=0):
    # keys + values (float32) + pos (int64) + float32 metadata
    return Bn * Hn * cap * (4 * D + 4 * DV + 8 + 4 * n_float_meta)


def test_capacity_grows_in_grow_chunk_steps_on_append():
    g = torch.Generator().manual_seed(0)
    cache = SieveCache(1, meta_init={"acc": 0.0}, grow_chunk=4)
    layer = cache.layers[0]
    model = empty_model()
    assert layer.allocated_bytes() == 0 and layer.capacity == 0
    caps = []
    for t in range(9):
        append(cache, model, g, [[t], [t]])
        caps.append(layer.capacity)
        assert layer.keys.shape[2] == layer.capacity == layer.meta["pos"].shape[2] == layer.meta["acc"].shape[2]
        assert layer.allocated_bytes() == expected_bytes(B, H, layer.capacity, 1)
    assert caps == [4, 4, 4, 4, 8, 8, 8, 8, 12]
    # A chunk larger than grow_chunk grows to exactly what it needs.
    append(cache, model, g, [list(range(9, 19)), list(range(9, 19))])
    assert layer.capacity == 19
    assert_layer_matches(layer, model)


def test_compaction_shrinks_capacity_and_returns_memory():
    g = torch.Generator().manual_seed(0)
    cache = SieveCache(2, meta_init={"acc": 0.0}, grow_chunk=64)
    layer = cache.layers[0]
    model = empty_model()
    append(cache, model, g, [list(range(40)), list(range(40))])
    before = layer.allocated_bytes()
    assert layer.capacity == 64 and before == expected_bytes(B, H, 64, 1)
    assert cache.allocated_bytes() == before  # layer 1 never used: holds nothing

    keep = torch.zeros(B, H, 64, dtype=torch.bool)
    keep[..., 30:40] = True
    compact_to(layer, model, keep, headroom=2)
    assert layer.capacity == 12
    after = layer.allocated_bytes()
    assert after == expected_bytes(B, H, 12, 1) < before
    # Really new, small tensors, not views into the old 64-slot storage.
    assert layer.keys.untyped_storage().nbytes() == B * H * 12 * D * 4
    assert layer.values.untyped_storage().nbytes() == B * H * 12 * DV * 4
    for t in layer.meta.values():
        assert t.untyped_storage().nbytes() == B * H * 12 * t.element_size()
    assert_layer_matches(layer, model)


def test_reserve_is_a_noop_when_room_exists_and_grows_by_at_least_a_chunk():
    g = torch.Generator().manual_seed(0)
    cache = SieveCache(1, grow_chunk=5)
    layer = cache.layers[0]
    append(cache, empty_model(), g, [[0], [0]])
    assert layer.capacity == 5
    layer.reserve(5)
    assert layer.capacity == 5
    layer.reserve(6)
    assert layer.capacity == 10
    layer.reserve(30)
    assert layer.capacity == 30
    assert (layer.meta["pos"][..., 1:] == DEAD_POS).all()


# ---------------------------------------------------------------------------- rows


def test_select_rows_drops_rows_consistently_everywhere():
    g = torch.Generator().manual_seed(3)
    Bn = 3
    cache = SieveCache(2, meta_init={"acc": 0.0}, grow_chunk=4)
    model = [empty_model(Bn), empty_model(Bn)]
    for layer in cache.layers:
        layer.query_window = 2
    for step, rows_pos in enumerate([[[0, 1, 2], [0, 1, 2], [DEAD_POS, 0, 1]], [[3], [3], [2]]]):
        for li, layer in enumerate(cache.layers):
            append(cache, model[li], g, rows_pos, layer_idx=li)
            layer.meta["acc"] += rand(g, *layer.meta["acc"].shape)
            layer.remember_queries(rand(g, Bn, 4, len(rows_pos[0]), D), torch.tensor(rows_pos))
    # Make the rows ragged before selecting.
    layer0 = cache.layers[0]
    keep = layer0.live().clone()
    keep[2, 1, 0] = False
    compact_to(layer0, model[0], keep, headroom=1)
    cache.seen_tokens = torch.tensor([4, 4, 3])

    before = [{
        "keys": layer.keys.clone(), "values": layer.values.clone(), "lengths": layer.lengths.clone(),
        "meta": {k: t.clone() for k, t in layer.meta.items()},
        "q": layer.recent_queries.clone(), "qpos": layer.recent_query_pos.clone(),
    } for layer in cache.layers]
    rows = torch.tensor([2, 0])
    cache.select_rows(rows)

    assert cache.seen_tokens.tolist() == [3, 4]
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer.keys, old["keys"][rows])
        assert torch.equal(layer.values, old["values"][rows])
        assert torch.equal(layer.lengths, old["lengths"][rows])
        assert layer.meta.keys() == old["meta"].keys()
        for name, t in layer.meta.items():
            assert torch.equal(t, old["meta"][name][rows])
        assert torch.equal(layer.recent_queries, old["q"][rows])
        assert torch.equal(layer.recent_query_pos, old["qpos"][rows])
        assert layer.recent_query_pos.tolist() == [[1, 2], [2, 3]]

    # Appending after selection still lands after each surviving head's live slots.
    for li in range(2):
        model[li] = [model[li][2], model[li][0]]
        append(cache, model[li], g, [[3], [4]], layer_idx=li)
        assert_layer_matches(cache.layers[li], model[li])
    assert cache.live_tokens().tolist() == [
        [sum(1 for toks in model[li][b] for p, _, _ in toks if p != DEAD_POS) for li in range(2)] for b in range(2)
    ]


def test_remember_queries_keeps_only_the_last_window_across_steps():
    g = torch.Generator().manual_seed(0)
    layer = SieveLayer()
    layer.remember_queries(rand(g, 1, 2, 3, D), torch.tensor([[0, 1, 2]]))
    assert layer.recent_queries is None  # no window asked for: nothing kept
    layer.query_window = 3
    q1, q2 = rand(g, 1, 2, 2, D), rand(g, 1, 2, 2, D)
    layer.remember_queries(q1, torch.tensor([[0, 1]]))
    layer.remember_queries(q2, torch.tensor([[2, 3]]))
    assert layer.recent_query_pos.tolist() == [[1, 2, 3]]
    assert torch.equal(layer.recent_queries, torch.cat([q1[:, :, 1:], q2], dim=2))


def test_kv_fields_computed_at_append_follow_their_tokens_through_compact_and_evict():
    """Per-token K/V statistics are computed once per token and then only moved: after appends,
    a compaction and an in-place eviction they still equal a recomputation on every live slot."""
    g = torch.Generator().manual_seed(5)
    layer = SieveLayer(kv_fields=("key_norm", "value_sqnorm"), grow_chunk=4)

    def append(n, first):
        pos = torch.arange(first, first + n).expand(2, n)
        layer.update(rand(g, 2, 2, n, D), rand(g, 2, 2, n, D), pos)

    def assert_fields_match():
        live = layer.live()
        for name in ("key_norm", "value_sqnorm"):
            fresh = KV_FIELDS[name](layer.keys, layer.values)
            assert torch.allclose(layer.meta[name][live], fresh[live])
            assert (layer.meta[name][~live] == 0).all()
            assert kv_field(layer, name) is layer.meta[name]

    append(7, 0)
    assert_fields_match()
    keep = torch.rand(2, 2, layer.capacity, generator=g) < 0.6
    keep[..., 7:] = False
    K = int(keep.sum(-1).max())
    kept_idx, lengths = indices_from_mask(keep, K)
    layer.compact(kept_idx, lengths, capacity=K + 3, max_len=K)
    assert_fields_match()
    append(2, 7)
    drop = torch.zeros(2, 2, 1, dtype=torch.long)  # every head drops its slot 0 in place
    layer.evict(drop, torch.ones(2, 2, dtype=torch.long), max_len=layer.max_len - 1)
    assert_fields_match()


def test_running_kv_sums_equal_a_recount_over_live_tokens_after_padding_evictions_compaction_and_row_exits():
    """KV_SUMS are kept by adding appended tokens and subtracting evicted ones: after left
    padding, in-place evictions of one and of several tokens, a compaction and a row leaving,
    each equals the sum recomputed over the live slots (float64, so no visible drift)."""
    g = torch.Generator().manual_seed(7)
    names = tuple(KV_SUMS)
    layer = SieveLayer(kv_fields=("key_norm",), kv_sums=names, grow_chunk=4)

    def assert_sums_match():
        live = layer.live()
        for name in names:
            fresh = (KV_SUMS[name](layer.keys, layer.values) * live[..., None]).sum(2, dtype=torch.float64)
            assert torch.allclose(layer.sums[name], fresh, atol=1e-10)
            assert kv_sum(layer, name) is layer.sums[name]

    pos = torch.tensor([[DEAD_POS, DEAD_POS, 0, 1, 2], [0, 1, 2, 3, 4]])  # row 0 left-padded
    layer.update(rand(g, 2, 3, 5, D), rand(g, 2, 3, 5, DV), pos)
    assert_sums_match()
    for step in range(5, 9):  # every-step eviction of one token (each head its own slot)
        layer.update(rand(g, 2, 3, 1, D), rand(g, 2, 3, 1, DV), torch.tensor([[step - 2], [step]]))
        drop = torch.randint(2, 5, (2, 3, 1), generator=g)  # live slots in both rows
        count = (torch.rand(2, 3, generator=g) < 0.7).long()  # some heads drop nothing
        layer.evict(drop, count, max_len=layer.max_len)
        assert_sums_match()
    drop = torch.tensor([2, 3]).expand(2, 3, 2).clone()  # two at once
    layer.evict(drop, torch.full((2, 3), 2), max_len=layer.max_len - 2)
    assert_sums_match()
    keep = layer.live() & (torch.rand(2, 3, layer.capacity, generator=g) < 0.7)
    K = int(keep.sum(-1).max())
    kept_idx, lengths = indices_from_mask(keep, K)
    layer.compact(kept_idx, lengths, capacity=K + 2, max_len=K)
    assert_sums_match()
    layer.select_rows(torch.tensor([1]))
    assert_sums_match()
    with pytest.raises(ValueError, match="unknown K/V running sums"):
        SieveLayer(kv_sums=("query_sum",))
    untracked = SieveLayer()
    untracked.update(layer.keys[:, :, :3], layer.values[:, :, :3], torch.tensor([[0, 1, 2]]))
    assert torch.allclose(kv_sum(untracked, "value_sum"), untracked.values.sum(2, dtype=torch.float64))


def test_keydiff_and_fastcaote_score_the_same_from_running_sums_as_from_a_recount():
    """KeyDiff's anchor and FastCAOTE's mean value read the cache's running sums; a layer that
    does not keep them (computed from scratch) gives the same scores."""
    from kvsieve import make_policy

    g = torch.Generator().manual_seed(8)
    for method in ("keydiff", "fastcaote:h2o"):
        scorer = make_policy(method, budget=8).scorer
        tracked = SieveCache(1, **scorer_fields(scorer)).layers[0]
        plain = SieveLayer(meta_init=scorer.needs.meta)
        assert tracked.kv_sums and not plain.kv_sums
        k, v = rand(g, 2, 3, 9, D), rand(g, 2, 3, 9, D)
        for layer in (tracked, plain):
            layer.update(k, v, torch.arange(9).expand(2, 9))
            layer.evict(torch.tensor([4]).expand(2, 3, 1).clone(), torch.ones(2, 3, dtype=torch.long), max_len=8)
        live = tracked.live()  # dead slots' scores are never read
        assert torch.equal(live, plain.live())
        assert torch.allclose(scorer.score(tracked, torch.tensor([9, 9]))[live],
                              scorer.score(plain, torch.tensor([9, 9]))[live], atol=1e-5)


def test_kv_field_is_computed_on_demand_for_a_layer_that_does_not_track_it_and_unknown_fields_fail():
    g = torch.Generator().manual_seed(6)
    layer = SieveLayer()
    layer.update(rand(g, 1, 2, 3, D), rand(g, 1, 2, 3, D), torch.tensor([[0, 1, 2]]))
    assert torch.allclose(kv_field(layer, "key_norm"), layer.keys.norm(dim=-1))
    with pytest.raises(ValueError, match="unknown per-token K/V fields"):
        SieveLayer(kv_fields=("key_mean",))
    from kvsieve import make_policy

    cache = SieveCache(1, **scorer_fields(make_policy("caote:keydiff", budget=8).scorer))
    assert cache.layers[0].kv_fields == ("key_norm", "value_sqnorm")


def test_query_window_equals_the_last_w_queries_over_many_steps_chunks_and_row_selection():
    """The window is a view into a 2w buffer that is only rewound when full: after any mix of
    decode steps, prefill chunks (shorter or longer than w) and rows leaving, it holds exactly
    the last w queries seen, oldest first."""
    g = torch.Generator().manual_seed(7)
    layer = SieveLayer()
    layer.update(rand(g, 3, 1, 2, D), rand(g, 3, 1, 2, D), torch.tensor([[0, 1]] * 3))  # rows to select from
    layer.query_window = 4
    all_q, all_p = None, None
    next_pos = 0
    for T in (3, 1, 1, 1, 2, 1, 6, 1, 1, 1, 1, 1, 2, 1):
        q = rand(g, 3 if all_q is None or all_q.shape[0] == 3 else 2, 2, T, D)
        if all_q is not None and all_q.shape[0] != q.shape[0]:
            q = q[: all_q.shape[0]]
        p = torch.arange(next_pos, next_pos + T).expand(q.shape[0], T)
        next_pos += T
        layer.remember_queries(q, p)
        all_q = q if all_q is None else torch.cat([all_q, q], dim=2)
        all_p = p if all_p is None else torch.cat([all_p, p], dim=1)
        assert torch.equal(layer.recent_queries, all_q[:, :, -4:])
        assert torch.equal(layer.recent_query_pos, all_p[:, -4:])
        if next_pos == 16:  # row 1 leaves the batch
            rows = torch.tensor([0, 2])
            layer.select_rows(rows)
            all_q, all_p = all_q[rows], all_p[rows]
            assert torch.equal(layer.recent_queries, all_q[:, :, -4:])
