"""AMS (Algorithm 1): each step on hand-made tensors against loop references written from the
paper's text, the wrapper's compression on a small cache, and end to end on SmolLM2."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvsieve import GenerateConfig, generate
from kvsieve.allocators import ALLOCATORS
from kvsieve.analysis.trace import TraceRecorder
from kvsieve.attention import StepState, sieve_attention, window_attention
from kvsieve.cache import DEAD_POS, LayerView, SieveCache
from kvsieve.methods import WRAPPERS, describe_methods, make_policy
from kvsieve.methods import _common
from kvsieve.methods.ams import CREDIT, ema_credit, missed_by, quality_mass, window_observations
from kvsieve.schedule import Schedule, compress_layer, indices_from_mask
from kvsieve.methods._segments import (SegmentQuotas, allocate_quotas, fill_to_budget, segment_ids, segment_starts,
                              top_per_segment)

B, H, G, D = 2, 2, 3, 8


def starts_of(lengths):
    """Start mask of consecutive segments with these lengths."""
    s = torch.zeros(sum(lengths), dtype=torch.bool)
    s[torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])] = True
    return s


def lengths_of(starts: torch.Tensor, n: int) -> list[int]:
    cut = [i for i in range(n) if starts[i]] + [n]
    return [b - a for a, b in zip(cut, cut[1:])]


def reference_segments(mass: list[float], delta: float, l_min: int, l_max: int) -> list[int]:
    """Sec. 3.3 from its text: cuts after b_k = min{t : c(t) >= k delta}; then short segments
    absorb their right neighbours (a short last one joins its left one); then segments longer
    than l_max are split into ceil(L / l_max) near-equal parts.  Returns the segment lengths."""
    T, cum, cuts = len(mass), 0.0, set()
    c = [sum(mass[: t + 1]) for t in range(T)]
    k = 1
    while k * delta < 1 - 1e-12:
        b = next((t + 1 for t in range(T) if c[t] >= k * delta - 1e-7), T)
        if b < T:
            cuts.add(b)
        k += 1
    raw = sorted({0, *cuts})
    merged = []
    for a in raw:
        if not merged or a - merged[-1] >= l_min:
            merged.append(a)
    if len(merged) > 1 and T - merged[-1] < l_min:
        merged.pop()
    lengths = [b - a for a, b in zip(merged, merged[1:] + [T])]
    out = []
    for L in lengths:
        p = math.ceil(L / l_max)
        out += [math.ceil((i + 1) * L / p) - math.ceil(i * L / p) for i in range(p)]
    return out


# ============================================================================ Step 3: segments


def test_cuts_fall_at_cumulative_mass_steps_of_delta():
    mass = torch.tensor([0.05, 0.05, 0.3, 0.02, 0.08, 0.1, 0.2, 0.1, 0.05, 0.05])  # sums to 1
    starts = segment_starts(mass, torch.tensor(10), delta=0.25, l_min=1, l_max=100)
    # c = .05 .1 .4 .42 .5 .6 .8 .9 .95 1: 0.25 first reached at t=2, .5 at t=4, .75 at t=6
    assert lengths_of(starts, 10) == [3, 2, 2, 3]
    seg_mass = torch.zeros(4).scatter_add_(0, segment_ids(starts), mass)
    assert torch.allclose(seg_mass, torch.tensor([0.4, 0.1, 0.3, 0.2]))


@pytest.mark.parametrize("seed", range(6))
def test_segments_match_the_text_and_respect_length_bounds(seed):
    g = torch.Generator().manual_seed(seed)
    T, n = 300, 300 - 17 * (seed % 3)
    raw = torch.rand(B, H, T, generator=g) ** 6  # spiky: many short raw segments
    raw[..., n:] = 0
    mass = raw / raw.sum(-1, keepdim=True)
    for delta, l_min, l_max in ((0.1, 16, 256), (0.02, 8, 40), (0.3, 5, 12)):
        starts = segment_starts(mass, torch.full((B, H), n), delta, l_min, l_max)
        for b in range(B):
            for h in range(H):
                lengths = lengths_of(starts[b, h], n)
                assert lengths == reference_segments(mass[b, h, :n].tolist(), delta, l_min, l_max)
                assert sum(lengths) == n and not starts[b, h, n:].any()
                assert all(l_min <= L <= l_max for L in lengths)  # l_max >= 2 l_min: both hold


def test_long_low_mass_stretch_is_split_into_near_equal_parts():
    mass = torch.full((50,), 1 / 50)
    lengths = lengths_of(segment_starts(mass, torch.tensor(50), delta=1.0, l_min=1, l_max=16), 50)
    assert lengths == [13, 12, 13, 12]


def test_short_segments_merge_and_a_short_tail_joins_its_left_neighbour():
    mass = torch.zeros(40)
    mass[[0, 2, 4, 6, 30, 38]] = 1 / 6  # raw cuts after 1, 3, 5, 7, 31, 39
    starts = segment_starts(mass, torch.tensor(40), delta=1 / 6 - 1e-6, l_min=5, l_max=100)
    assert lengths_of(starts, 40) == [5, 26, 9]  # [0,5) absorbs [1,3), [3,5); tail [39,40) joins


# ============================================================================ Step 4: quotas


def test_quotas_are_minimum_plus_proportional_share_summing_exactly():
    quota = allocate_quotas(torch.tensor([[0.5, 0.3, 0.2, 0.0]]), torch.tensor([[10, 2, 10, 0]]),
                            torch.tensor([9]), q_min=1)
    # min 1 each, rest 6 -> 3, 1.8, 1.2 -> 3 + 2 + 1 by largest remainder; segment 1 holds 2 of its
    # 3 (L_1 = 2), the spare one goes to the heaviest segment with room
    assert quota.tolist() == [[5, 2, 2, 0]]


@pytest.mark.parametrize("seed", range(5))
def test_quotas_sum_to_the_budget_within_capacities(seed):
    g = torch.Generator().manual_seed(seed)
    S = 12
    capacity = torch.randint(0, 30, (4, S), generator=g)
    capacity[:, 9:] = 0  # unused segment slots
    mass = torch.rand(4, S, generator=g) * (capacity > 0)
    total = torch.tensor([0, 5, 40, 500])
    for q_min in (0, 1, 8):
        quota = allocate_quotas(mass, capacity, total, q_min)
        assert (quota >= 0).all() and (quota <= capacity).all()
        assert quota.sum(-1).tolist() == torch.minimum(total, capacity.sum(-1)).tolist()
        room = total >= capacity.clamp(max=q_min).sum(-1)
        assert (quota[room] >= capacity[room].clamp(max=q_min)).all()  # q_i >= min(q_min, L_i)


# ============================================================================ Step 5: selection


def test_top_q_per_segment_by_base_score():
    g = torch.Generator().manual_seed(3)
    score = torch.randn(B, H, 30, generator=g)
    seg = segment_ids(starts_of([7, 10, 13])).expand(B, H, 30).contiguous()
    selectable = torch.rand(B, H, 30, generator=g) > 0.3
    quota = torch.tensor([2, 4, 3]).expand(B, H, 3)
    chosen = top_per_segment(seg, score, selectable, torch.cat([quota, torch.zeros(B, H, 27, dtype=torch.long)], -1))
    for b in range(B):
        for h in range(H):
            for s, (a, e) in enumerate(((0, 7), (7, 17), (17, 30))):
                cand = [t for t in range(a, e) if selectable[b, h, t]]
                best = sorted(cand, key=lambda t: -score[b, h, t])[: quota[b, h, s]]
                assert set(torch.nonzero(chosen[b, h, a:e]).flatten().add(a).tolist()) == set(best)


def test_fill_keeps_sinks_then_newest_recent_when_must_keep_exceeds_the_budget():
    valid = torch.ones(1, 12, dtype=torch.bool)
    must = torch.zeros(1, 12, dtype=torch.bool)
    must[0, [0, 1, 7, 8, 9, 10, 11]] = True
    sink = torch.zeros_like(must)
    sink[0, :2] = True
    kept = fill_to_budget(torch.zeros_like(must), must, sink, torch.randn(1, 12), valid, torch.tensor([5]))
    assert torch.nonzero(kept[0]).flatten().tolist() == [0, 1, 9, 10, 11]  # Sec. 3.3: the suffix shrinks


def test_fill_trims_lowest_picks_and_backfills_best_rest():
    score = torch.tensor([[0.0, 5, 1, 4, 2, 3, 9, 8]])
    valid = torch.ones(1, 8, dtype=torch.bool)
    must = torch.zeros(1, 8, dtype=torch.bool)
    must[0, 0] = True
    chosen = torch.tensor([[False, True, True, True, False, False, False, False]])
    trimmed = fill_to_budget(chosen, must, must, score, valid, torch.tensor([3]))
    assert torch.nonzero(trimmed[0]).flatten().tolist() == [0, 1, 3]  # position 2 (score 1) trimmed
    filled = fill_to_budget(chosen, must, must, score, valid, torch.tensor([6]))
    assert torch.nonzero(filled[0]).flatten().tolist() == [0, 1, 2, 3, 6, 7]  # best of the rest: 9, 8


# ============================================================================ Steps 1-2: mass, credit


def test_mass_pads_masked_observations_with_the_window_max():
    probs = torch.zeros(1, 1, 1, 2, 4)
    probs[..., 0, :3] = torch.tensor([0.5, 0.3, 0.2])  # query at position 2 sees keys 0-2
    probs[..., 1, :] = torch.tensor([0.1, 0.2, 0.3, 0.4])  # query at 3 sees all
    key_pos = torch.arange(4).view(1, 1, 4)
    live = torch.ones(1, 1, 4, dtype=torch.bool)
    mass = quality_mass(probs, torch.tensor([[2, 3]]), key_pos, live, kernel=1, eps=0.0)
    usage = torch.tensor([0.3, 0.25, 0.25, (0.5 + 0.4) / 2])  # key 3: missing observation -> max 0.5
    assert torch.allclose(mass[0, 0], usage / usage.sum())
    eps = quality_mass(probs, torch.tensor([[2, 3]]), key_pos, live, kernel=1, eps=1.0)
    assert torch.allclose(eps[0, 0], (usage + 1) / (usage + 1).sum())  # Eq. (1)


@pytest.mark.parametrize("rows_at_once", [1, 3, 8])
def test_window_observed_a_few_rows_at_a_time_gives_the_whole_windows_sums(rows_at_once, monkeypatch):
    """``window_observations`` attends a few rows at a time (``row_chunks``): its sum over the
    queries and window maximum equal, bit for bit, those of the whole batch's ``window_attention``
    (padding queries, dead slots, keys after the queries), and so does the mass built from them."""
    g = torch.Generator().manual_seed(7)
    rows, S, w = 8, 24, 6
    pos = torch.randperm(S, generator=g).repeat(rows, H, 1) + 30  # slots in any order
    pos[2, :, 20:] = DEAD_POS
    qpos = torch.arange(w).repeat(rows, 1) + 30 + S - w  # the window's queries see part of the cache
    qpos[5, :2] = DEAD_POS  # padding queries
    view = LayerView(torch.randn(rows, H, S, D, generator=g), None, torch.full((rows, H), S), {"pos": pos}, {},
                     torch.randn(rows, H * G, w, D, generator=g), qpos, D ** -0.5, {}, 0, S)
    monkeypatch.setattr(_common, "CHUNK_BYTES", rows_at_once * H * G * w * S * 4)
    total, top = window_observations(view)
    probs = window_attention(view)  # [rows, H, G, w, S]
    assert torch.equal(total, probs.sum(dim=-2)) and torch.equal(top, probs.amax(dim=(-1, -2))[..., None])
    live = pos != DEAD_POS
    assert torch.equal(quality_mass(None, qpos, pos, live, 5, 1e-12, observed=(total, top)),
                       quality_mass(probs, qpos, pos, live, 5, 1e-12))


def test_missed_counts_the_real_window_queries_before_each_key():
    """Per key, the real queries (padding at DEAD_POS, any order) that come before it, as a loop
    over (query, key) counts them; a dead key (DEAD_POS) is missed by every real query."""
    g = torch.Generator().manual_seed(4)
    query_pos = torch.randint(0, 40, (3, 6), generator=g)
    query_pos[1, :2] = DEAD_POS  # padding queries
    query_pos[2] = query_pos[2].flip(0)
    key_pos = torch.randint(0, 45, (3, 2, 9), generator=g)
    key_pos[0, 1, 4] = DEAD_POS
    counts = missed_by(query_pos, key_pos)
    for b in range(3):
        real = [int(q) for q in query_pos[b] if q != DEAD_POS]
        for h in range(2):
            for s in range(9):
                assert int(counts[b, h, s]) == sum(q < int(key_pos[b, h, s]) for q in real)
    assert int(counts[0, 1, 4]) == 6


def test_ema_credit_update_and_mixture():
    credit = torch.tensor([[0.2, 0.0, 0.4, 7.0]])
    mass = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    live = torch.tensor([[True, True, True, False]])
    new, used = ema_credit(credit, mass, live, lam=0.9, beta=0.7)
    expect = torch.tensor([[0.9 * 0.2 + 0.05, 0.025, 0.9 * 0.4 + 0.025, 7.0]])  # dead slot untouched
    assert torch.allclose(new, expect)
    norm = expect[0, :3] / expect[0, :3].sum()
    mix = 0.7 * mass[0, :3] + 0.3 * norm
    assert torch.allclose(used[0, :3], mix / mix.sum()) and used[0, 3] == 0


# ============================================================================ the wrapper


def small_cache(policy, seed=0, prompt=(30, 24), decode=6):
    """Prefill two rows (row 1 left padded), drop padding, decode a few steps."""
    g = torch.Generator().manual_seed(seed)
    cache = SieveCache(1, meta_init=policy.scorer.needs.meta, grow_chunk=8)
    layer = cache.layers[0]
    layer.query_window = policy.scorer.needs.query_window
    P = max(prompt)
    pos = torch.tensor([[DEAD_POS] * (P - p) + list(range(p)) for p in prompt])

    def step(qpos):
        T = qpos.shape[1]
        cache.begin_step(qpos)
        k, v = layer.update(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g), qpos)
        sieve_attention(SimpleNamespace(layer_idx=0), torch.randn(B, H * G, T, D, generator=g) * 2, k, v,
                        scaling=0.35, kvsieve=StepState(cache, qpos, None))

    step(pos)
    idx, n = indices_from_mask(layer.live(), P)  # drop the padding, as generate does
    layer.compact(idx, n, capacity=P + decode, max_len=P)
    seen = torch.tensor(prompt)
    for _ in range(decode):
        step(seen[:, None])
        seen = seen + 1
    return layer, seen


@pytest.mark.parametrize("order", ["sec3.3", "alg1"])
@pytest.mark.parametrize("base", ["tova", "keydiff", "expected"])
def test_every_head_keeps_exactly_t_keep_with_sinks_and_recent_and_kv_moved(order, base):
    policy = make_policy(f"ams:{base}", budget=16, sinks=2, recent=3, interval=4, mass_window=6, delta=0.2,
                         l_min=2, l_max=8, order=order)
    layer, seen = small_cache(policy)
    before = {(b, h, int(p)): layer.keys[b, h, s].clone()
              for b in range(B) for h in range(H) for s, p in enumerate(layer.meta["pos"][b, h]) if p != DEAD_POS}
    compress_layer(layer, policy, 16, seen)
    assert layer.lengths.tolist() == [[16, 16], [16, 16]] and layer.max_len == 16
    assert layer.capacity == 16 + 4  # room for the next interval: the peak is T_keep + I
    for b in range(B):
        for h in range(H):
            kept = layer.meta["pos"][b, h, :16].tolist()
            n = int(seen[b])
            assert {0, 1, n - 3, n - 2, n - 1} <= set(kept) and kept == sorted(kept)  # must-keep
            for s, p in enumerate(kept):
                assert torch.equal(layer.keys[b, h, s], before[(b, h, p)])  # K moved with its position


@pytest.mark.parametrize("order", ["sec3.3", "alg1"])
@pytest.mark.parametrize("base", ["tova", "keydiff"])
def test_kept_tokens_do_not_depend_on_the_slot_order(order, base):
    """Pooling, segments and quotas read neighbours by position (vLLM's worker moves kept tokens
    into freed slots, ``Needs.slot_order_free``): the same cache with its live slots shuffled in
    every head keeps the same positions, with their keys, as the cache in position order."""
    policy = make_policy(f"ams:{base}", budget=16, sinks=2, recent=3, interval=4, mass_window=6, delta=0.2,
                         l_min=2, l_max=8, order=order)
    assert policy.scorer.needs.slot_order_free and policy.scorer.needs.selects
    ordered, seen = small_cache(policy, seed=3)
    shuffled, _ = small_cache(policy, seed=3)
    n = shuffled.lengths  # [B, H] live slots, a prefix of each head
    cap = shuffled.capacity
    g = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.stack([torch.cat([torch.randperm(int(n[b, h]), generator=g),
                                               torch.arange(int(n[b, h]), cap)]) for h in range(H)]) for b in range(B)])
    shuffled.compact(idx, n, capacity=cap, max_len=shuffled.max_len)
    assert not torch.equal(shuffled.meta["pos"], ordered.meta["pos"])
    for layer in (ordered, shuffled):
        compress_layer(layer, policy, 16, seen)
    for b in range(B):
        for h in range(H):
            want = dict(zip(ordered.meta["pos"][b, h, :16].tolist(), ordered.keys[b, h, :16]))
            got = dict(zip(shuffled.meta["pos"][b, h, :16].tolist(), shuffled.keys[b, h, :16]))
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[p], want[p]) for p in want)


def test_kvsieve_engine_never_drops_ams_tokens_by_scores_alone():
    """AMS's keep-set is its ``select``'s: an every-step AMS is not evicted inside the step."""
    policy = make_policy("ams:tova", budget=16, sinks=2, recent=3, interval=1)
    layer, _ = small_cache(policy)
    assert not Schedule(policy, SimpleNamespace(layers=[layer]), horizon=64).evicts_in_step
    tova = make_policy("tova", budget=16, sinks=2, recent=3, interval=1)
    assert Schedule(tova, SimpleNamespace(layers=[layer]), horizon=64).evicts_in_step


def test_credit_is_the_ema_of_the_mass_and_new_tokens_enter_at_zero():
    policy = make_policy("ams:keydiff", budget=16, sinks=2, recent=3, interval=4, mass_window=6, ema_lambda=0.6)
    layer, seen = small_cache(policy)
    layer.meta[CREDIT] = torch.rand(layer.meta[CREDIT].shape) * layer.live()
    old = layer.meta[CREDIT].clone()
    live = layer.live()
    probs = window_attention(layer)[:, :, :, -6:]
    cur = quality_mass(probs, layer.recent_query_pos[:, -6:], layer.meta["pos"], live, 5, 1e-12)
    pos_before = layer.meta["pos"].clone()
    compress_layer(layer, policy, 16, seen)
    expect = 0.6 * old + 0.4 * cur
    for b in range(B):
        for h in range(H):
            for s in range(16):
                slot = (pos_before[b, h] == layer.meta["pos"][b, h, s]).nonzero().item()
                assert torch.isclose(layer.meta[CREDIT][b, h, s], expect[b, h, slot], atol=1e-6)
    layer.update(torch.zeros(B, H, 1, D), torch.zeros(B, H, 1, D), seen[:, None])
    assert (layer.meta[CREDIT][:, :, 16] == 0).all()  # a new token enters with credit 0


def test_heads_keep_different_tokens_and_segments_guarantee_coverage():
    policy = make_policy("ams:keydiff", budget=40, sinks=2, recent=4, interval=8, mass_window=8, delta=0.1,
                         l_min=4, l_max=16, q_min=1)
    layer, seen = small_cache(policy, prompt=(70, 60), decode=8)
    compress_layer(layer, policy, 40, seen)
    kept = layer.meta["pos"][..., :40]
    assert any(not torch.equal(kept[b, 0], kept[b, 1]) for b in range(B))
    # every 16-token stretch (<= l_max) keeps something: no region is wiped out
    for b in range(B):
        for h in range(H):
            n = int(seen[b])
            ks = kept[b, h].tolist()
            assert all(any(a <= p < a + 32 for p in ks) for a in range(0, n - 31))


def test_base_sees_only_its_own_window_and_layer_averaging_bases_score_per_head():
    policy = make_policy("ams:rkv", budget=16, sinks=2, recent=3, interval=4, window=4, mass_window=12)
    assert (policy.scorer.inner.window, policy.scorer.mass_window, policy.scorer.needs.query_window) == (4, 12, 12)
    layer, seen = small_cache(policy)
    ams_scores = policy.scorer.score(layer, seen)
    layer.recent_queries, layer.recent_query_pos = layer.recent_queries[:, :, -4:], layer.recent_query_pos[:, -4:]
    torch.testing.assert_close(ams_scores, policy.scorer.inner.score(layer, seen))
    tova = make_policy("ams:tova", budget=16, sinks=2, recent=3, interval=4, mass_window=6)
    layer, seen = small_cache(tova)
    per_head = make_policy("tova", budget=16, heads="group").scorer.score(_last_query(layer), seen)
    torch.testing.assert_close(tova.scorer.score(layer, seen), per_head)
    assert make_policy("ams:expected", budget=64, epsilon=0.05).scorer.inner.epsilon == 0.05


def _last_query(layer):
    layer.recent_queries, layer.recent_query_pos = layer.recent_queries[:, :, -1:], layer.recent_query_pos[:, -1:]
    return layer


def test_wrapper_registration_settings_and_errors():
    assert {"ams", "ams-released"} <= set(WRAPPERS)
    paper, released = make_policy("ams:tova", budget=64), make_policy("ams-released:tova", budget=64)
    assert (paper.sinks, paper.recent, paper.interval, paper.compress_prefill) == (4, 32, 32, False)  # 512 capped at B/2
    assert make_policy("ams:tova", budget=2048).interval == 512  # Table 15's I where the budget allows it
    assert make_policy("ams:tova", budget=64, interval=512).interval == 512  # an explicit interval is kept
    assert paper.scorer.name == "ams:tova" and paper.scorer.needs.query_window == 128
    s = released.scorer
    released_values = (s.mass_window, s.delta, s.l_min, s.l_max, s.q_min, s.ema_lambda, s.ema_beta)
    assert released_values == (32, 0.02, 32, 1024, 8, 0.8, 0.7)
    assert (s.segmentation, s.order, released.recent) == ("batch", "alg1", 32)
    assert make_policy("ams:expected", budget=64).scorer.needs.query_window == 256  # HS buffer of the base
    assert any(r["name"] == "ams:<base>" for r in describe_methods())
    with pytest.raises(ValueError, match="order must be one of"):
        make_policy("ams:tova", budget=64, order="first")
    with pytest.raises(ValueError, match="l_min <= l_max"):
        make_policy("ams:tova", budget=64, l_min=40, l_max=20)
    with pytest.raises(ValueError, match="smaller than the protected tokens"):
        make_policy("ams:tova", budget=20)  # sinks 4 + recent 32


def test_segments_and_quotas_are_an_allocator_built_from_the_wrappers_settings():
    """Steps 3-5 belong to a SegmentQuotas that the wrapper builds from its own settings (their
    names stay the wrapper's); it needs a mass, so it is no ``--allocator``."""
    released = make_policy("ams-released:tova", budget=64).scorer.allocation
    assert released == SegmentQuotas(delta=0.02, l_min=32, l_max=1024, q_min=8, segmentation="batch", order="alg1")
    assert make_policy("ams:tova", budget=64, delta=0.05).scorer.allocation.delta == 0.05
    assert SegmentQuotas not in ALLOCATORS.values()
    with pytest.raises(ValueError, match="segmentation must be one of"):
        SegmentQuotas(delta=0.1, l_min=16, l_max=256, q_min=1, segmentation="rows", order="sec3.3")
    with pytest.raises(ValueError, match="0 < delta <= 1"):
        make_policy("ams:tova", budget=64, delta=0.0)


def test_settings_report_the_base_scorers_settings():
    """Policy.settings() holds the base's hyperparameters under "base" (next to AMS's own), so
    AMS-TOVA and AMS-Expected runs with different base settings are told apart in result rows."""
    tova = make_policy("ams:tova", budget=64, heads="group").settings()
    assert tova["base"] == {"heads": "group"} and tova["mass_window"] == 128 and tova["interval"] == 32
    assert make_policy("ams:tova", budget=64).settings()["base"] == {"heads": "layer"}
    assert make_policy("ams:expected", budget=64, epsilon=0.05).settings()["base"]["epsilon"] == 0.05
    assert make_policy("ams-released:rkv", budget=64, window=4).settings()["base"]["window"] == 4
    assert "base" not in {k for r in describe_methods() if r["name"] == "ams:<base>" for k in r["params"]}


def test_decode_only_over_every_base():
    """App. B.2 / Table 12: AMS compresses only while decoding, also over a base that reads the
    prompt block-wise on its own (CAOTE, Sec. 4.1); AMS's interval I replaces the base's."""
    for base in ("tova", "caote:tova", "fastcaote:h2o", "snapkv"):
        policy = make_policy(f"ams:{base}", budget=2048)
        assert (policy.compress_prefill, policy.prefill_block, policy.interval) == (False, False, 512)


# ============================================================================ end to end (SmolLM2)

SHORT = "What is 7 times 8?"
LONG = ("Here is a short story. A fox lived near a river and every morning it walked to the water "
        "to drink. One day it met a heron standing on one leg. Tell me, in two sentences, what the fox said.")


def test_ams_tova_with_budget_above_length_reproduces_full(smollm, full_greedy):
    model, tok = smollm
    full = full_greedy([SHORT, LONG], 24)
    ours = generate(model, tok, [SHORT, LONG], make_policy("ams:tova", budget=4096), GenerateConfig(max_new_tokens=24))
    assert ours.token_ids == full.token_ids and all(s.compression_events == 0 for s in ours.stats)


@pytest.mark.parametrize("name", ["ams:tova", "ams:expected", "ams:caote:tova"])
def test_small_budget_keeps_exactly_t_keep_per_head_and_peaks_at_t_keep_plus_interval(smollm, name):
    model, tok = smollm
    t_keep, interval = 40, 16
    recorder = TraceRecorder()
    policy = make_policy(name, budget=t_keep, interval=interval, recent=8, mass_window=16)
    config = GenerateConfig(max_new_tokens=56, ignore_eos=True)  # both rows run to the end
    result = generate(model, tok, [SHORT, LONG], recorder.wrap(policy), config)
    trace = recorder.finish()
    heads = model.config.num_key_value_heads
    assert trace.lost == 0 and len(trace) > 0
    assert all(len(kept) == t_keep for kept in trace.kept)  # every (row, layer, head), every event
    short, long_ = result.stats
    assert short.prompt_tokens < t_keep < long_.prompt_tokens
    assert short.compression_events == long_.compression_events == 3  # decode steps 16, 32, 48
    assert max(short.peak_kv_tokens) == heads * (t_keep + interval)  # T_keep + I
    assert max(long_.peak_kv_tokens) == heads * (long_.prompt_tokens + interval)  # decode-only: prompt + I
    assert any(not (a == b).all() for a, b in zip(trace.kept[::heads], trace.kept[1::heads]))  # per head
