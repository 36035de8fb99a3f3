"""Each eviction method's defining formula, recomputed here from the paper's definition with
plain loops over (row, kv head, token), against the scorer's ``score(layer, seen_tokens)``;
plus the invariants ``compress_layer`` guarantees for every method, the allocators, and the
errors of ``Policy`` / ``make_policy``.

Caches are built the way the engine builds them (``begin_step`` + ``update`` +
``sieve_attention`` with the policy's observer and query window), from small seeded tensors;
no model is loaded.  The reference keeps its own list of (position, key, value) per
(row, kv head) and never reads the cache's slot layout except to map a slot to its position.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvsieve.allocators import AdaKV, Pyramid, Uniform, make_allocator
from kvsieve.attention import StepState, sieve_attention
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.policy import SCORERS
from kvsieve.methods import describe_methods, make_policy, method_names
from kvsieve.methods.h2o import H2O
from kvsieve.methods.keydiff import KeyDiff
from kvsieve.methods.knorm import Knorm
from kvsieve.methods.random import RandomScorer
from kvsieve.methods.rkv import RKV
from kvsieve.methods.snapkv import SnapKV
from kvsieve.methods.tova import TOVA
from kvsieve.policy import Policy, Scorer
from kvsieve.schedule import compress_layer, indices_from_mask, layer_budgets, observer

B, HKV, G, D = 2, 2, 3, 8
HQ = HKV * G
MODULE = SimpleNamespace(layer_idx=0)
SCALE = 0.35

# Methods that keep a budget of tokens (LagKV sets its own size from its partitions).
BUDGETED = [m for m in method_names()[1:] if SCORERS[m].needs.uses_budget]


@functools.cache
def calibrated(name: str) -> dict:
    """Settings a method needs beyond a budget without a model: TriAttention's statistics file,
    here random statistics of this file's head shapes (its equations are checked in
    tests/methods); LazyEviction's and RaaS's model family for alpha (a model sets it in a run)."""
    if name in ("lazy", "raas"):
        return {"family": "qwen2"}
    if name != "triattention":
        return {}
    from kvsieve.methods.triattention import QueryStats

    g = torch.Generator().manual_seed(0)
    q_mean = torch.randn(1, HQ, D // 2, 2, generator=g)
    stats = QueryStats(q_mean=q_mean, q_abs_mean=q_mean.norm(dim=-1) * 1.5,
                       inv_freq=10000.0 ** -(torch.arange(0, D, 2, dtype=torch.float64) / D), attention_scaling=1.0,
                       num_kv_heads=HKV, model_name="synthetic", fingerprint={})
    path = Path(tempfile.mkdtemp()) / "triattention.pt"
    stats.save(path)
    return {"stats": str(path)}


# ============================================================================ building caches


@dataclass
class Built:
    cache: SieveCache
    tokens: list  # tokens[b][h] = [(pos, key, value), ...] in slot order (reference copy)
    calls: list  # every attention call: (q [B, HQ, T, D], qpos [B, T], tokens as that call saw them)
    seen: torch.Tensor | None = None  # [B] real tokens per row

    @property
    def layer(self):
        return self.cache.layers[0]


def attend(built: Built, g, qpos_rows, observer=None):
    """One decoder-layer attention call: append the new K/V, then run sieve_attention."""
    T = len(qpos_rows[0])
    qpos = torch.tensor(qpos_rows)
    q = torch.randn(B, HQ, T, D, generator=g)
    k, v = torch.randn(B, HKV, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g)
    built.cache.begin_step(qpos)
    key, value = built.cache.update(k, v, 0)
    sieve_attention(MODULE, q, key, value, scaling=SCALE, kvsieve=StepState(built.cache, qpos, observer))
    for b in range(B):
        for h in range(HKV):
            built.tokens[b][h].extend((qpos_rows[b][t], k[b, h, t], v[b, h, t]) for t in range(T))
    built.calls.append((q, qpos, [[list(toks) for toks in row] for row in built.tokens]))


def build(seed, *, counts=((8, 5), (6, 8)), aligned=False, window=0, meta_init=None, observer=None,
          pad=2, S=10, n_decode=3, pad_row=1) -> Built:
    """Prefill S tokens (row ``pad_row`` left padded by ``pad``), compact each (row, kv head)
    to ``counts[b][h]`` random live tokens (the same ones in every head of a row if
    ``aligned``), then ``n_decode`` decode steps.  The capacity after the compaction is
    exactly filled by the decode steps, so a head shorter than the longest one has dead
    slots at its end."""
    g = torch.Generator().manual_seed(seed)
    cache = SieveCache(1, meta_init=meta_init, grow_chunk=4)
    cache.layers[0].query_window = window
    built = Built(cache, [[[] for _ in range(HKV)] for _ in range(B)], [])
    prefill = [list(range(S)) for _ in range(B)]
    prefill[pad_row] = [DEAD_POS] * pad + list(range(S - pad))
    attend(built, g, prefill, observer)
    layer = built.layer
    keep = torch.zeros(B, HKV, layer.capacity, dtype=torch.bool)
    for b in range(B):
        live = [s for s in range(S) if built.tokens[b][0][s][0] != DEAD_POS]
        row_pick = torch.randperm(len(live), generator=g)
        for h in range(HKV):
            pick = row_pick if aligned else torch.randperm(len(live), generator=g)
            chosen = sorted(live[i] for i in pick[: counts[b][h]].tolist())
            keep[b, h, chosen] = True
            built.tokens[b][h] = [built.tokens[b][h][s] for s in chosen]
    K = int(keep.sum(-1).max())
    kept_idx, lengths = indices_from_mask(keep, K)
    layer.compact(kept_idx, lengths, capacity=K + n_decode, max_len=K)
    n_real = [len(set(p for p, _, _ in built.calls[0][2][b][0]) - {DEAD_POS}) for b in range(B)]
    for i in range(n_decode):
        attend(built, g, [[n_real[b] + i] for b in range(B)], observer)
    built.seen = torch.tensor([n + n_decode for n in n_real])
    return built


def attn_row(tokens_bh, q, qp) -> dict[int, float]:
    """Reference attention {position: prob} of one query vector over one head's token list."""
    toks = [(p, k) for p, k, _ in tokens_bh if p != DEAD_POS and p <= qp]
    w = torch.softmax(torch.stack([k for _, k in toks]) @ q * SCALE, dim=0)
    return {p: float(x) for (p, _), x in zip(toks, w)}


def window_queries(built: Built, w: int, b: int):
    """Row b's last ``w`` queries as [(q [HQ, D], pos)], padding queries left out."""
    q = torch.cat([c[0] for c in built.calls], dim=2)[b]  # [HQ, N, D]
    qpos = torch.cat([c[1] for c in built.calls], dim=1)[b]  # [N]
    N = q.shape[1]
    return [(q[:, t], int(qpos[t])) for t in range(max(0, N - w), N) if qpos[t] != DEAD_POS]


def window_votes(built: Built, w: int, b: int, h: int) -> dict[int, list[dict[int, float]]]:
    """For each query head of kv head h: the attention rows of row b's real window queries
    over the *current* cache (what the scorer sees at compression time)."""
    return {hq: [attn_row(built.tokens[b][h], q[hq], qp) for q, qp in window_queries(built, w, b)]
            for hq in range(h * G, (h + 1) * G)}


def live_positions(built: Built, b, h) -> list[int]:
    return [p for p, _, _ in built.tokens[b][h] if p != DEAD_POS]


def live_keys(built: Built, b, h) -> list[torch.Tensor]:
    return [k for p, k, _ in built.tokens[b][h] if p != DEAD_POS]


def pool(values: list[float], kernel: int, how: str) -> list[float]:
    """Same-length 1D pooling over a head's live sequence; borders use fewer values."""
    r = kernel // 2
    out = []
    for i in range(len(values)):
        win = values[max(0, i - r) : i + r + 1]
        out.append(sum(win) / len(win) if how == "avg" else max(win))
    return out


def assert_live_scores(built: Built, scores: torch.Tensor, expected, atol=1e-5):
    """scores [B, HKV, cap] equal expected[b][h][pos] on every live slot."""
    layer = built.layer
    assert scores.shape == (B, HKV, layer.capacity)
    n_checked = 0
    for b in range(B):
        for h in range(HKV):
            for s in range(int(layer.lengths[b, h])):
                p = int(layer.meta["pos"][b, h, s])
                if p == DEAD_POS:
                    continue
                assert float(scores[b, h, s]) == pytest.approx(expected[b][h][p], abs=atol), (b, h, p)
                n_checked += 1
    assert n_checked == sum(len(live_positions(built, b, h)) for b in range(B) for h in range(HKV)) > 0


def test_build_helper_produces_a_ragged_cache_with_trailing_dead_slots():
    built = build(0)
    layer = built.layer
    assert layer.lengths.tolist() == [[11, 8], [9, 11]]
    assert layer.capacity == 11
    assert (layer.meta["pos"][0, 1, 8:] == DEAD_POS).all()
    assert built.seen.tolist() == [13, 11]
    for b in range(B):
        for h in range(HKV):
            assert layer.meta["pos"][b, h, : layer.lengths[b, h]].tolist() == live_positions(built, b, h)


# ============================================================================ streaming


def test_streaming_keeps_the_sinks_and_the_newest_tokens_exactly():
    policy = make_policy("streaming", budget=7)
    assert (policy.sinks, policy.recent) == (4, 0)
    built = build(0, counts=((8, 4), (6, 8)))
    layer = built.layer
    before = [[live_positions(built, b, h) for h in range(HKV)] for b in range(B)]
    compress_layer(layer, policy, 7, built.seen)
    for b in range(B):
        for h in range(HKV):
            sinks = [p for p in before[b][h] if p < 4]
            rest = [p for p in before[b][h] if p >= 4]
            expected = sinks + rest[len(rest) - (7 - len(sinks)):]
            n = int(layer.lengths[b, h])
            assert n == 7
            assert layer.meta["pos"][b, h, :n].tolist() == expected
            assert expected[-1] == int(built.seen[b]) - 1


def test_streaming_on_a_full_sequence_is_four_sinks_then_a_contiguous_recent_block():
    cache = SieveCache(1)
    cache.begin_step(torch.arange(20).expand(1, 20))
    cache.update(torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4), 0)
    compress_layer(cache.layers[0], make_policy("streaming", budget=10), 10, torch.tensor([20]))
    assert cache.layers[0].meta["pos"][0, 0, :10].tolist() == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19]


# ============================================================================ h2o


def test_h2o_observe_adds_attention_summed_over_group_and_queries():
    cache = SieveCache(1, meta_init=H2O.needs.meta)
    cache.begin_step(torch.arange(5).expand(B, 5))
    cache.update(torch.randn(B, HKV, 5, D), torch.randn(B, HKV, 5, D), 0)
    layer = cache.layers[0]
    cap = layer.capacity
    g = torch.Generator().manual_seed(0)
    calls = [torch.rand(B, HKV, G, T, cap, generator=g) for T in (3, 1, 2)]
    scorer = H2O()
    for probs in calls:
        scorer.observe(layer, probs, torch.zeros(B, probs.shape[3], dtype=torch.long))
    for b in range(B):
        for h in range(HKV):
            for s in range(cap):
                expected = sum(float(p[b, h, gi, t, s]) for p in calls for gi in range(G) for t in range(p.shape[3]))
                assert float(layer.meta["acc"][b, h, s]) == pytest.approx(expected, rel=1e-5)
    assert torch.equal(scorer.score(layer, None), layer.meta["acc"])


def h2o_reference(built: Built) -> list:
    """acc[b][h][pos]: total attention each live token received from every real query (all query
    heads of its group), each query attending over what its head held at that time."""
    acc = [[{p: 0.0 for p in live_positions(built, b, h)} for h in range(HKV)] for b in range(B)]
    for q, qpos, held in built.calls:
        for b in range(B):
            for t in range(q.shape[2]):
                qp = int(qpos[b, t])
                if qp == DEAD_POS:
                    continue
                for hq in range(HQ):
                    h = hq // G
                    for p, x in attn_row(held[b][h], q[b, hq, t], qp).items():
                        if p in acc[b][h]:
                            acc[b][h][p] += x
    return acc


def test_h2o_score_is_total_attention_received_across_steps_and_compaction():
    policy = make_policy("h2o", budget=6)
    assert policy.recent == 3  # half the budget is the recent window (H2O Sec. 5)
    built = build(1, pad=0, meta_init=policy.scorer.needs.meta, observer=observer(policy))
    assert_live_scores(built, policy.scorer.score(built.layer, built.seen), h2o_reference(built))


def test_h2o_recent_rule_half_or_lazyevictions_window_recorded_and_overridable():
    """H2O Sec. 5: recent = budget // 2 (the default rule, "half").  LazyEviction App. C: "the
    number of recent tokens in H2O is equal to LazyEviction's window size", W = 25 (its Table 3):
    rule "lazy-window".  An explicit recent wins over either; the rule is in the settings and in
    ``kvsieve methods``."""
    paper_w = 25  # LazyEviction Table 3 / Table 9 (GSM8K)
    for budget in (50, 64, 128, 4096):
        half = make_policy("h2o", budget=budget)
        lazy_window = make_policy("h2o", budget=budget, recent_rule="lazy-window")
        assert (half.recent, half.settings()["recent_rule"]) == (budget // 2, "half")
        assert (lazy_window.recent, lazy_window.settings()["recent_rule"]) == (paper_w, "lazy-window")
        assert lazy_window.recent == make_policy("lazy", budget=budget).recent  # lazy's own W
        assert lazy_window.interval == 1  # the paper's H2O evicts every step; Table 3's "+ window" sets interval
    assert make_policy("h2o", budget=100, recent_rule="lazy-window", recent=8).recent == 8
    with pytest.raises(ValueError, match=r"h2o recent_rule must be one of \['half', 'lazy-window'\]"):
        make_policy("h2o", budget=100, recent_rule="window")
    with pytest.raises(ValueError, match="budget 16 is smaller than the protected tokens: sinks 0 \\+ recent 25"):
        make_policy("h2o", budget=16, recent_rule="lazy-window")
    row = {r["name"]: r for r in describe_methods()}["h2o"]
    assert row["params"]["recent_rule"] == "half" and "lazy-window" in row["params"]["recent"]


def test_h2o_score_ignores_padding_queries_of_a_left_padded_row():
    policy = make_policy("h2o", budget=6)
    built = build(1, pad=3, meta_init=policy.scorer.needs.meta, observer=observer(policy))
    assert_live_scores(built, policy.scorer.score(built.layer, built.seen), h2o_reference(built))


# ============================================================================ tova


def tova_reference(built: Built, heads: str) -> list:
    exp = [[{} for _ in range(HKV)] for _ in range(B)]
    for b in range(B):
        (q, qp), = window_queries(built, 1, b)
        rows = {hq: attn_row(built.tokens[b][hq // G], q[hq], qp) for hq in range(HQ)}
        for h in range(HKV):
            for p in live_positions(built, b, h):
                group = range(HQ) if heads == "layer" else range(h * G, (h + 1) * G)
                exp[b][h][p] = sum(rows[hq].get(p, 0.0) for hq in group) / len(group)
    return exp


def test_tova_group_score_is_the_last_querys_attention_averaged_over_the_group():
    scorer = TOVA(heads="group")
    assert scorer.needs.query_window == 1
    policy = Policy(scorer=scorer, budget=8)
    built = build(2, window=scorer.needs.query_window, meta_init=scorer.needs.meta, observer=observer(policy))
    # the score read from the forward pass equals a fresh recomputation over the cache
    torch.testing.assert_close(scorer.score(built.layer, built.seen),
                               scorer.score_per_query_head(built.layer, built.seen).mean(dim=2))
    assert_live_scores(built, scorer.score(built.layer, built.seen), tova_reference(built, "group"))


def test_tova_layer_score_is_the_last_querys_attention_averaged_over_all_query_heads():
    scorer = TOVA()  # heads="layer" is the paper's choice and the default
    # TOVA-layer keeps the same tokens in every head, so build a cache whose heads agree.
    built = build(3, window=scorer.needs.query_window, aligned=True, counts=((7, 7), (5, 5)),
                  meta_init=scorer.needs.meta, observer=observer(Policy(scorer=scorer, budget=8)))
    scores = scorer.score(built.layer, built.seen)
    assert_live_scores(built, scores, tova_reference(built, "layer"))
    assert torch.equal(scores[:, 0], scores[:, 1])  # one ranking for the whole layer


# ============================================================================ snapkv


def snapkv_reference(built: Built, window: int, kernel: int, pooling: str) -> list:
    exp = [[{} for _ in range(HKV)] for _ in range(B)]
    for b in range(B):
        for h in range(HKV):
            rows = window_votes(built, window, b, h)
            live = live_positions(built, b, h)
            votes = [sum(sum(r.get(p, 0.0) for r in rows[hq]) for hq in rows) / G for p in live]
            exp[b][h] = dict(zip(live, pool(votes, kernel, pooling)))
    return exp


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_score_is_window_votes_summed_mean_over_group_then_pooled_kernel_5(pooling):
    scorer = SnapKV(window=4, pooling=pooling)
    assert scorer.kernel == 5 and SnapKV().pooling == "avg"
    # window 4 = the last decode steps plus the prefill's last real query; row 1 is padded.
    built = build(4, window=4, counts=((8, 8), (8, 8)), pad=2)
    assert (built.layer.lengths == built.layer.capacity).all()  # no dead slot beside a live one
    expected = snapkv_reference(built, 4, 5, pooling)
    assert_live_scores(built, scorer.score(built.layer, built.seen), expected)


def test_snapkv_window_larger_than_the_history_counts_only_real_queries():
    scorer = SnapKV(window=64)  # the default window: longer than everything seen
    built = build(5, window=64, counts=((8, 8), (8, 8)), pad=2)
    assert built.layer.recent_queries.shape[2] == 13  # 10 prefill + 3 decode queries
    assert_live_scores(built, scorer.score(built.layer, built.seen), snapkv_reference(built, 64, 5, "avg"))


# ============================================================================ knorm, keydiff


def test_knorm_score_is_the_negated_l2_norm_of_each_key():
    built = build(6)
    expected = [[{p: -math.sqrt(sum(float(x) ** 2 for x in k)) for p, k, _ in built.tokens[b][h] if p != DEAD_POS}
                 for h in range(HKV)] for b in range(B)]
    assert_live_scores(built, Knorm().score(built.layer, built.seen), expected)


def test_keydiff_score_is_negated_cosine_to_the_mean_of_normalised_live_keys():
    built = build(7)
    expected = [[{} for _ in range(HKV)] for _ in range(B)]
    for b in range(B):
        for h in range(HKV):
            keys = live_keys(built, b, h)
            unit = [k / k.norm() for k in keys]
            anchor = sum(unit) / len(unit)
            for p, k in zip(live_positions(built, b, h), keys):
                expected[b][h][p] = -float(F.cosine_similarity(k, anchor, dim=0))
    assert_live_scores(built, KeyDiff().score(built.layer, built.seen), expected)


# ============================================================================ rkv


def rkv_redundancy_reference(built: Built, b: int, h: int, threshold: float | None) -> list[float]:
    """Official ``cal_similarity``: pairwise cosine, each row's latest partner above ``threshold``
    set to 0, mean over rows, softmax over tokens."""
    keys = live_keys(built, b, h)
    n = len(keys)
    cos = [[0.0 if i == j else float(F.cosine_similarity(keys[i], keys[j], dim=0)) for j in range(n)]
           for i in range(n)]
    if threshold is not None:
        for i in range(n):
            partners = [j for j in range(n) if j != i and cos[i][j] > threshold]
            if partners:
                cos[i][max(partners)] = 0.0
    mean_sim = [sum(cos[i][j] for i in range(n) if i != j) / (n - 1) for j in range(n)]
    z = sum(math.exp(s) for s in mean_sim)
    return [math.exp(s) / z for s in mean_sim]


def rkv_reference(built: Built, window: int, kernel: int, lam: float, threshold: float | None = 0.5) -> list:
    """kvsieve's reading before issue 51 (head_reduction="mean", window_keys=True): per query head a
    softmax over every key the query sees, averaged over the window, then over the group."""
    exp = [[{} for _ in range(HKV)] for _ in range(B)]
    for b in range(B):
        for h in range(HKV):
            live = live_positions(built, b, h)
            rows = window_votes(built, window, b, h)
            importance = [sum(sum(r.get(p, 0.0) for r in rows[hq]) / len(rows[hq]) for hq in rows) / G for p in live]
            importance = pool(importance, kernel, "max")
            redundancy = rkv_redundancy_reference(built, b, h, threshold)
            exp[b][h] = {p: lam * i - (1 - lam) * r for p, i, r in zip(live, importance, redundancy)}
    return exp


def rkv_official_reference(built: Built, window: int, kernel: int, lam: float, threshold: float | None = 0.5) -> list:
    """The official ``R1KV.update_kv`` by hand: logits q.k * scale of each window query, the max over
    the query group (``compute_attention_scores(pooling="max")``), a softmax over the keys before the
    window only (``attn_weights[..., -window:, :-window]``), the mean over the window's queries and a
    max-pool.  The official pool runs over the tokens before the window, padded with -inf; here the
    window's tokens count 0 in the pool over every live token, which gives the same value for every
    token before the window (probabilities are >= 0) and scores the window (always kept) by its
    neighbours."""
    exp = [[{} for _ in range(HKV)] for _ in range(B)]
    for b in range(B):
        queries = window_queries(built, window, b)  # [(q [HQ, D], pos)]
        oldest = min(pos for _, pos in queries)
        for h in range(HKV):
            live = live_positions(built, b, h)
            before = [(p, k) for p, k in zip(live, live_keys(built, b, h)) if p < oldest]
            sums = {p: 0.0 for p in live}
            for q, _ in queries:
                logits = [max(float(k @ q[hq]) * SCALE for hq in range(h * G, (h + 1) * G)) for _, k in before]
                z = sum(math.exp(x) for x in logits)
                for (p, _), x in zip(before, logits):
                    sums[p] += math.exp(x) / z / len(queries)
            pooled = pool([sums[p] for p in live], kernel, "max")
            official = pool([sums[p] for p, _ in before], kernel, "max")  # over the tokens before the window
            assert pooled[: len(before)] == official
            redundancy = rkv_redundancy_reference(built, b, h, threshold)
            exp[b][h] = {p: lam * i - (1 - lam) * r for p, i, r in zip(live, pooled, redundancy)}
    return exp


@pytest.mark.parametrize("lam,threshold", [(0.1, 0.5), (0.6, 0.5), (0.1, 0.2), (0.1, None)])
def test_rkv_score_is_lambda_importance_minus_weighted_redundancy(lam, threshold):
    scorer = RKV(window=4, kernel=3, mix_lambda=lam, partner_threshold=threshold, head_reduction="mean",
                 window_keys=True)
    built = build(8, window=4)  # ragged heads with dead slots
    want = rkv_reference(built, 4, 3, lam, threshold)
    assert_live_scores(built, scorer.score(built.layer, built.seen), want, atol=1e-6)


@pytest.mark.parametrize("seed,lam", [(8, 0.07), (11, 0.5)])
def test_rkv_official_importance_is_the_group_max_of_logits_softmaxed_over_keys_before_the_window(seed, lam):
    built = build(seed, window=4, n_decode=3)  # the window: the last prefill query and three decode steps
    scorer = RKV(window=4, kernel=3, mix_lambda=lam)
    assert_live_scores(built, scorer.score(built.layer, built.seen), rkv_official_reference(built, 4, 3, lam),
                       atol=1e-6)
    # and it is not the earlier reading: the official formula moves the scores
    old = RKV(window=4, kernel=3, mix_lambda=lam, head_reduction="mean", window_keys=True)
    assert not torch.allclose(scorer.score(built.layer, built.seen), old.score(built.layer, built.seen), atol=1e-4)


def test_rkv_defaults_follow_the_official_code():
    scorer = RKV()
    # official R1KV(window_size=8, kernel_size=7, mix_lambda=0.07); compute_attention_scores(pooling="max")
    assert (scorer.window, scorer.kernel, scorer.mix_lambda, scorer.needs.query_window) == (8, 7, 0.07, 8)
    assert (scorer.head_reduction, scorer.window_keys) == ("max-logits", False)
    assert scorer.partner_threshold == 0.5  # official rkv/utils.py cal_similarity(threshold=0.5)
    policy = make_policy("rkv", budget=512)
    assert policy.interval == 128  # R-KV's buffer
    assert not policy.protect_prompt and policy.compress_prefill  # the prompt is compressed at prefill
    assert make_policy("rkv", budget=64).interval == 32  # capped at budget // 2: a budget stays a bound
    assert make_policy("rkv", budget=64, protect_prompt=True).protect_prompt  # the named option
    built = build(9, window=8)
    assert_live_scores(built, scorer.score(built.layer, built.seen), rkv_official_reference(built, 8, 7, 0.07),
                       atol=1e-6)
    red = scorer.redundancy(built.layer)
    live = built.layer.live()
    torch.testing.assert_close(red.sum(-1), torch.ones(B, HKV))
    assert (red[~live] == 0).all()



# ============================================================================ random


def test_random_scores_repeat_for_a_seed_and_change_with_another_seed():
    built = build(10)
    a = RandomScorer(seed=0).score(built.layer, built.seen)
    b = RandomScorer(seed=0).score(built.layer, built.seen)
    c = RandomScorer(seed=1).score(built.layer, built.seen)
    assert a.shape == (B, HKV, built.layer.capacity)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert ((a >= 0) & (a < 1)).all()
    assert make_policy("random", budget=4, seed=5).scorer.seed == 5


def test_random_draws_the_same_scores_in_every_generate_call_of_one_policy():
    """``attach`` (entered once per generate call) restarts the seeded generator, so reusing a
    policy object repeats a run instead of continuing the first call's random stream."""
    built = build(10)
    scorer = RandomScorer(seed=3)
    draws = []
    for _ in range(2):
        with scorer.attach(None, None):
            draws.append([scorer.score(built.layer, built.seen) for _ in range(2)])
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    assert not torch.equal(draws[0][0], draws[0][1])  # within a call the stream goes on


# ============================================================================ dead slots


SCORER_FACTORIES = {
    "h2o": lambda: make_policy("h2o", budget=6),
    "tova": lambda: make_policy("tova", budget=6, heads="group"),
    "snapkv_max": lambda: make_policy("snapkv", budget=6, window=4, pooling="max", recent=2),
    "snapkv_avg": lambda: make_policy("snapkv", budget=6, window=4, recent=2),
    "knorm": lambda: make_policy("knorm", budget=6),
    "keydiff": lambda: make_policy("keydiff", budget=6),
    "rkv": lambda: make_policy("rkv", budget=6, window=4, kernel=3),
    "streaming": lambda: make_policy("streaming", budget=6),
}


def policy_cache(name, seed, **kw):
    policy = SCORER_FACTORIES[name]()
    built = build(seed, window=policy.scorer.needs.query_window, meta_init=policy.scorer.needs.meta,
                  observer=observer(policy), **kw)
    return policy, built


@pytest.mark.parametrize("name", list(SCORER_FACTORIES))
def test_live_scores_do_not_depend_on_trailing_dead_slots(name):
    """Growing the store (more dead slots after every head's live ones) changes no live score."""
    policy, built = policy_cache(name, 11, counts=((8, 8), (8, 8)))
    before = policy.scorer.score(built.layer, built.seen).clone()
    built.layer.reserve(built.layer.capacity + 5)
    after = policy.scorer.score(built.layer, built.seen)
    live = built.layer.live()[..., : before.shape[-1]]
    assert live.sum() > 0
    torch.testing.assert_close(after[..., : before.shape[-1]][live], before[live], rtol=1e-5, atol=1e-6)


# ============================================================================ compress_layer


@pytest.mark.parametrize("name", BUDGETED)
@pytest.mark.parametrize("seed", [0, 1])
def test_compress_layer_keeps_protected_drops_dead_respects_budget_and_position_order(name, seed):
    kw = {"window": 4} if name in ("snapkv", "rkv") else {"window": 3} if name == "lazy" else {}  # lazy: B >= 2W
    policy = make_policy(name, budget=6, sinks=2, recent=3, **kw, **calibrated(name))
    # Row 0 head 1 ends up with fewer live tokens (2 + 3 decoded) than the budget; row 1 is left padded.
    built = build(seed, window=policy.scorer.needs.query_window, meta_init=policy.scorer.needs.meta,
                  observer=observer(policy), counts=((9, 2), (7, 8)), pad=3)
    layer = built.layer
    before = {(b, h): {p: (k, v) for p, k, v in built.tokens[b][h] if p != DEAD_POS}
              for b in range(B) for h in range(HKV)}
    compress_layer(layer, policy, 6, built.seen)

    assert layer.max_len == int(layer.lengths.max()) <= 6
    if policy.scorer.needs.slot_order_free:  # evicted in place: the allocation stays (never above steady state)
        assert layer.capacity <= layer.max_len + policy.interval
    else:
        assert layer.capacity == layer.max_len + policy.interval
    for b in range(B):
        seen = int(built.seen[b])
        for h in range(HKV):
            n = int(layer.lengths[b, h])
            kept = layer.meta["pos"][b, h, :n].tolist()
            live_before = before[b, h]
            assert n == min(6, len(live_before))  # uniform: exactly the budget when there is enough
            assert DEAD_POS not in kept  # dead slots are never kept
            assert len(set(kept)) == n  # no duplicates
            if not policy.scorer.needs.slot_order_free:  # order-free scorers may be evicted in place
                assert kept == sorted(kept)  # position order
            assert set(kept) <= set(live_before)
            protected = {p for p in live_before if p < 2 or p >= seen - 3}
            assert protected <= set(kept)
            assert (layer.meta["pos"][b, h, n:] == DEAD_POS).all()
            for s, p in enumerate(kept):  # K/V moved with their position
                assert torch.equal(layer.keys[b, h, s], live_before[p][0])
                assert torch.equal(layer.values[b, h, s], live_before[p][1])


ORDER_FREE = [m for m in BUDGETED if SCORERS[m].needs.slot_order_free]


@pytest.mark.parametrize("name", ORDER_FREE)
def test_in_place_eviction_keeps_exactly_what_the_gather_path_keeps(name, monkeypatch):
    """Same scores, same budget: ``SieveLayer.evict`` (order-free scorers at steady capacity)
    and the dense top-k gather keep the same (position, K, V, meta) set in every head; where
    scores tie, they may pick different tied tokens, but the kept scores are the same."""
    import kvsieve.schedule as schedule_module

    kept, kept_scores = {}, {}
    for in_place in (True, False):
        monkeypatch.setattr(schedule_module, "can_evict_in_place", lambda *a, _v=in_place: _v)
        policy = make_policy(name, budget=6, sinks=1, recent=1, interval=3, **calibrated(name))
        built = build(3, window=policy.scorer.needs.query_window, meta_init=policy.scorer.needs.meta,
                      observer=observer(policy), counts=((6, 6), (6, 5)), aligned=policy.scorer.needs.aligned_heads)
        layer = built.layer
        score_of = {(b, h, int(p)): float(x) for b in range(B) for h in range(HKV)
                    for p, x in zip(layer.meta["pos"][b, h], policy.scorer.score(layer, built.seen)[b, h])}
        compress_layer(layer, policy, 6, built.seen)
        kept[in_place], kept_scores[in_place] = {}, {}
        for b in range(B):
            for h in range(HKV):
                slots = range(int(layer.lengths[b, h]))
                kept[in_place][b, h] = sorted(
                    (int(layer.meta["pos"][b, h, s]), layer.keys[b, h, s].tolist(), layer.values[b, h, s].tolist(),
                     [float(t[b, h, s]) for n, t in sorted(layer.meta.items()) if n != "pos"]) for s in slots)
                kept_scores[in_place][b, h] = sorted(score_of[b, h, int(layer.meta["pos"][b, h, s])] for s in slots)
    assert kept_scores[True] == kept_scores[False]
    if name not in ("lazy", "raas"):  # timestamp scores tie on these small random streams
        assert kept[True] == kept[False]


@dataclass
class _HatesProtected(Scorer):
    """Scores the first and last positions lowest, so only protection can keep them."""

    def score(self, layer, seen_tokens):
        pos = layer.meta["pos"].float()
        return -(pos - seen_tokens[:, None, None].float() / 2).abs()


def test_protected_sinks_and_recent_survive_even_with_the_lowest_scores():
    policy = Policy(scorer=_HatesProtected(), budget=7, sinks=2, recent=3)
    cache = SieveCache(1)
    cache.begin_step(torch.arange(20).expand(B, 20))
    cache.update(torch.randn(B, HKV, 20, D), torch.randn(B, HKV, 20, D), 0)
    compress_layer(cache.layers[0], policy, 7, torch.tensor([20, 20]))
    kept = cache.layers[0].meta["pos"][..., :7]
    # sinks 0, 1 + recent 17, 18, 19 + the two middle-most tokens 10 and then 9 or 11
    for b in range(B):
        for h in range(HKV):
            ks = kept[b, h].tolist()
            assert ks[:2] == [0, 1] and ks[-3:] == [17, 18, 19] and 10 in ks


def test_compress_layer_is_a_noop_when_the_layer_fits_its_budget():
    built = build(0)
    keys = built.layer.keys.clone()
    compress_layer(built.layer, make_policy("knorm", budget=11), 11, built.seen)
    assert torch.equal(built.layer.keys, keys) and built.layer.lengths.tolist() == [[11, 8], [9, 11]]


# ============================================================================ allocators


@pytest.mark.parametrize("budget,layers,protected,beta", [
    (128, 24, 8, 20.0), (64, 28, 4, 20.0), (256, 32, 64, 5.0), (37, 7, 3, 2.0), (16, 2, 0, 20.0),
    (11, 12, 10, 20.0),  # one evictable slot per layer on average
])
def test_pyramid_budgets_fall_with_depth_stay_above_protected_and_average_to_the_budget(budget, layers, protected, beta):
    budgets = Pyramid(beta=beta).layer_budgets(budget, layers, protected)
    assert len(budgets) == layers
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert all(x >= protected for x in budgets)
    assert abs(sum(budgets) / layers - budget) <= 1
    if layers > 1 and budget - protected >= 10:
        assert budgets[0] > budgets[-1]  # a real pyramid, not a flat line
    # the smallest evictable budget is about c / beta
    if layers > 1:
        assert budgets[-1] - protected == max(0, round((budget - protected) / beta))


def test_pyramid_with_a_single_layer_gives_that_layer_the_whole_budget():
    assert Pyramid().layer_budgets(100, 1, 10) == [100]


def test_policy_layer_budgets_pass_the_protected_tokens_to_the_allocator():
    policy = make_policy("snapkv", budget=100, window=16, sinks=4, allocator="pyramid", allocator_beta=4)
    budgets = layer_budgets(policy, 10)
    assert budgets == Pyramid(beta=4).layer_budgets(100, 10, 20)
    assert min(budgets) >= 20
    assert layer_budgets(make_policy("knorm", budget=50, skip_layers=0), 3) == [50, 50, 50]


def test_knorm_leaves_its_first_two_layers_uncompressed_as_the_authors_do():
    assert layer_budgets(make_policy("knorm", budget=50), 4) == [None, None, 50, 50]
    assert layer_budgets(make_policy("caote:knorm", budget=50, skip_layers=1), 3) == [None, 50, 50]
    with pytest.raises(ValueError, match="skip_layers must be >= 0"):
        make_policy("knorm", budget=50, skip_layers=-1)


def test_pyramid_rejects_beta_below_one():
    with pytest.raises(ValueError, match="beta must be >= 1"):
        Pyramid(beta=0.5).layer_budgets(64, 4, 0)


def adakv_reference(scores: torch.Tensor, budget: int, floor: float) -> torch.Tensor:
    """Per row: each head's top floor*budget, then the best remaining scores across heads
    until H * budget slots are taken (finite scores only)."""
    Bn, Hn, S = scores.shape
    keep = torch.zeros_like(scores, dtype=torch.bool)
    for b in range(Bn):
        for h in range(Hn):
            order = sorted(range(S), key=lambda s: -float(scores[b, h, s]))
            for s in order[: int(floor * budget)]:
                if scores[b, h, s] > float("-inf"):
                    keep[b, h, s] = True
        rest = sorted(((float(scores[b, h, s]), h, s) for h in range(Hn) for s in range(S)
                       if not keep[b, h, s] and scores[b, h, s] > float("-inf")), reverse=True)
        for _, h, s in rest[: Hn * budget - int(keep[b].sum())]:
            keep[b, h, s] = True
    return keep


def test_adakv_select_matches_the_guarantee_then_global_top_k_rule():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 15, generator=g) * torch.tensor([0.1, 1.0, 3.0, 10.0])[:, None]
    scores[1, 2, 5:] = float("-inf")  # a head with only 5 live tokens
    keep, K = AdaKV(floor=0.4).select(scores, 5, 5)
    assert K is None
    assert torch.equal(keep & (scores > float("-inf")), adakv_reference(scores, 5, 0.4))


def test_adakv_keeps_h_times_budget_per_row_with_a_floor_per_head_and_uneven_heads():
    budget, floor = 6, 0.5
    policy = make_policy("knorm", budget=budget, allocator="adakv", allocator_floor=floor)
    g = torch.Generator().manual_seed(1)
    Hn, S = 4, 20
    # knorm keeps small keys: head 0 has tiny keys, head 3 huge ones.
    keys = torch.randn(B, Hn, S, D, generator=g) * torch.tensor([0.05, 0.5, 1.0, 20.0])[:, None, None]
    cache = SieveCache(1)
    cache.begin_step(torch.arange(S).expand(B, S))
    cache.update(keys, torch.randn(B, Hn, S, D, generator=g), 0)
    layer = cache.layers[0]
    scores = -keys.norm(dim=-1)
    compress_layer(layer, policy, budget, torch.tensor([S, S]))
    lengths = layer.lengths
    assert lengths.sum(dim=1).tolist() == [Hn * budget] * B
    assert (lengths >= math.floor(floor * budget)).all()
    assert (lengths.max(dim=1).values > lengths.min(dim=1).values).all()  # heads differ
    assert layer.max_len == int(lengths.max()) > budget  # a head took more than its share
    expected = adakv_reference(scores, budget, floor)
    for b in range(B):
        for h in range(Hn):
            n = int(lengths[b, h])
            assert layer.meta["pos"][b, h, :n].tolist() == torch.nonzero(expected[b, h]).flatten().tolist()


def test_adakv_total_stays_h_times_budget_when_some_heads_are_short():
    policy = make_policy("knorm", budget=6, allocator="adakv")
    built = build(12, counts=((9, 2), (3, 8)), n_decode=1)  # heads with 3 and 4 live tokens
    live = built.layer.live().sum(-1)
    assert (live.sum(-1) >= HKV * 6).all()
    compress_layer(built.layer, policy, 6, built.seen)
    lengths = built.layer.lengths
    assert lengths.sum(dim=1).tolist() == [HKV * 6] * B
    assert (lengths <= live).all()
    assert not (built.layer.meta["pos"][..., : built.layer.max_len] == DEAD_POS)[
        torch.arange(built.layer.max_len) < lengths[..., None]].any()


def test_adakv_rejects_a_floor_outside_zero_one():
    with pytest.raises(ValueError, match=r"floor must be in \[0, 1\]"):
        AdaKV(floor=1.5).select(torch.zeros(1, 2, 4), 2, 2)


def test_uniform_select_keeps_each_heads_top_k():
    scores = torch.tensor([[[3.0, 1.0, 2.0, 0.0], [0.0, float("inf"), 5.0, float("-inf")]]])
    keep, K = Uniform().select(scores, 2, 2)
    assert K == 2
    assert keep.tolist() == [[[True, False, True, False], [False, True, True, False]]]


# ============================================================================ policy errors


def test_unknown_method_error_lists_every_method():
    with pytest.raises(ValueError, match="unknown method 'h3o'") as err:
        make_policy("h3o", budget=64)
    for name in ("full", "streaming", "h2o", "tova", "snapkv", "knorm", "keydiff", "rkv", "random"):
        assert name in str(err.value)


def test_budget_below_protected_tokens_names_sinks_and_recent():
    with pytest.raises(ValueError, match="budget 10") as err:
        make_policy("snapkv", budget=10, window=8, sinks=4)
    assert "sinks 4" in str(err.value) and "recent 8" in str(err.value) and "12" in str(err.value)
    with pytest.raises(ValueError, match="sinks 4 \\+ recent 0"):
        make_policy("streaming", budget=3)
    assert make_policy("streaming", budget=4).budget == 4  # exactly the protected tokens is fine


@pytest.mark.parametrize("kw,message", [
    ({"sinks": -1}, "sinks= must be >= 0, got -1"),
    ({"recent": -2}, "recent= must be >= 0, got -2"),
    ({"interval": 0}, "interval= must be >= 1, got 0"),
    ({"budget": -5}, "method 'h2o' needs a positive budget= (tokens per row and kv head)"),
    ({"budget": 0}, "method 'h2o' needs a positive budget= (tokens per row and kv head)"),
])
def test_negative_or_zero_settings_are_rejected_by_their_keyword(kw, message):
    with pytest.raises(ValueError) as err:
        make_policy("h2o", **{"budget": 64, **kw})
    assert str(err.value) == message


def test_missing_budget_is_an_error_for_every_evicting_method():
    for name in BUDGETED:
        with pytest.raises(ValueError, match=f"method '{name}' needs a positive budget="):
            make_policy(name, **calibrated(name))
    assert make_policy("full").scorer is None  # no eviction needs no budget


def test_unknown_setting_names_are_rejected_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['windw'\] for 'snapkv'") as err:
        make_policy("snapkv", budget=128, windw=32)
    for allowed in ("window", "kernel", "pooling", "sinks", "recent", "interval", "allocator_*"):
        assert allowed in str(err.value)
    with pytest.raises(ValueError, match="unknown allocator 'pyramd'"):
        make_policy("snapkv", budget=128, allocator="pyramd")


def test_settings_are_routed_to_scorer_schedule_and_allocator():
    policy = make_policy("snapkv", budget=100, window=16, kernel=7, sinks=2, interval=4,
                         allocator="pyramid", allocator_beta=8)
    assert (policy.scorer.window, policy.scorer.kernel) == (16, 7)
    assert (policy.sinks, policy.recent, policy.interval) == (2, 16, 4)
    assert isinstance(policy.allocator, Pyramid) and policy.allocator.beta == 8
    s = policy.settings()
    assert s["method"] == "snapkv" and s["allocator"] == "pyramid" and s["allocator_beta"] == 8 and s["window"] == 16
    assert isinstance(make_allocator("adakv", floor=0.3), AdaKV)


@pytest.mark.parametrize("name", ["expected", "ams:tova", "ams:expected", "snapkv", "rkv", "skipkv", "lazy"])
def test_default_interval_is_at_most_half_the_budget_so_a_budget_is_a_bound(name):
    """Issue 28: expected and AMS default to interval 512 (AMS Table 15, for budgets of 2k and up);
    at budget 128 a 512-token run would never compress. Unless set, every interval is <= B / 2,
    so the cache peaks at 1.5 x budget at most; a setting given explicitly is kept."""
    settings = {"window": 25} if name == "lazy" else {}
    for budget in (64, 128, 4096):
        policy = make_policy(name, budget=budget, **settings)
        assert 1 <= policy.interval <= budget // 2
        assert policy.settings()["interval"] == policy.interval  # recorded in every result row
    assert make_policy("expected", budget=4096).interval == 512
    assert make_policy("expected", budget=128, interval=512).interval == 512


# ---------------------------------------------------------------------------- the scorer contract (issue 32)
def test_a_scorer_declares_its_whole_contract_in_ten_names():
    """Scorer's public surface: name, about, the two records and six hooks; nothing else is read
    (LagKV's budget fit and peak are one hook, ``sized``: issue 48)."""
    public = {n for n in vars(Scorer) if not n.startswith("_")} - {f.name for f in dataclasses.fields(Scorer)}
    assert public == {"name", "about", "needs", "defaults", "attach", "observe", "score", "select",
                      "should_compress", "sized"}


def test_a_wrapper_forwards_every_hook_of_the_contract_to_its_base():
    """A hook a wrapper does not override reaches its base: WrappingScorer overrides each one."""
    from kvsieve.methods._wrapper import WrappingScorer

    hooks = {n for n, v in vars(Scorer).items() if callable(v) and not n.startswith("_")}
    assert hooks and hooks <= set(vars(WrappingScorer))


@pytest.mark.parametrize("name", ["caote:snapkv", "fastcaote:h2o", "ams:knorm", "ams:caote:tova"])
def test_a_wrappers_records_derive_from_its_bases(name):
    """What a wrapper does not change of its base's needs and defaults is the base's."""
    scorer = make_policy(name, budget=64).scorer
    base = scorer.inner
    for field in ("observes", "observes_last_only", "per_token_hook", "whole_layers", "uses_budget"):
        assert getattr(scorer.needs, field) == getattr(base.needs, field), field
    assert set(base.needs.meta) <= set(scorer.needs.meta) and set(base.needs.kv_fields) <= set(scorer.needs.kv_fields)
    assert scorer.needs.query_window >= base.needs.query_window
    for key, value in type(scorer).schedule.items():
        assert getattr(scorer.defaults, key) == value
    untouched = {f.name for f in dataclasses.fields(base.defaults)} - set(type(scorer).schedule)
    assert all(getattr(scorer.defaults, f) == getattr(base.defaults, f) for f in untouched)
