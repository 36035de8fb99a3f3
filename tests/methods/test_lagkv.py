"""LagKV, LocalKV and LagKV-L2 (arXiv:2504.04704): the score equations recomputed with plain
loops, per-partition selection, the recursive schedule (Eq. 10 lengths, the window of
L + ((n - S) mod L) tokens, frozen partitions, nothing below S + 2L), and end to end on the
bundled SmolLM2 without attention weights."""

from __future__ import annotations

import math

import pytest
import torch

import kvsieve.attention as attention_module
from kvsieve import GenerateConfig, generate
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.methods import make_policy
from kvsieve.methods.lagkv import LagKV
from kvsieve.policy import compress, compress_layer, drop_dead

H, D = 2, 3
SHORT = "What is 7 times 8?"
LONG = ("Here is a short story. A fox lived near a river and every morning it walked to the water "
        "to drink. One day it met a heron standing on one leg. Tell me, in two sentences, what the fox said.")


def retained(n: int, S: int, L: int, k: int) -> int:
    """Eq. (10): cache length after compressing n tokens (no compression below S + 2L)."""
    if n < S + 2 * L:
        return n
    return S + k * ((n - S) // L - 1) + L + (n - S) % L


class Stream:
    """Per-row token streams with fixed random K/V per position, appended like the engine does."""

    def __init__(self, seed, rows, layers=1, dims=D):
        g = torch.Generator().manual_seed(seed)
        self.kv = [(torch.randn(n, H, dims, generator=g), torch.randn(n, H, dims, generator=g)) for n in rows]
        self.cache = SieveCache(layers, grow_chunk=8)
        self.seen = torch.zeros(len(rows), dtype=torch.long)

    def append(self, counts, width):
        """Append ``width`` columns; row b gets counts[b] real tokens, left padded to the width."""
        B, layers = len(self.kv), len(self.cache.layers)
        k, v = torch.zeros(B, H, width, self.kv[0][0].shape[-1]), torch.zeros(B, H, width, self.kv[0][0].shape[-1])
        pos = torch.full((B, width), DEAD_POS, dtype=torch.long)
        for b, c in enumerate(counts):
            first = int(self.seen[b])
            k[b, :, width - c:] = self.kv[b][0][first:first + c].transpose(0, 1)
            v[b, :, width - c:] = self.kv[b][1][first:first + c].transpose(0, 1)
            pos[b, width - c:] = torch.arange(first, first + c)
        self.cache.begin_step(pos)
        for i in range(layers):
            self.cache.update(k, v, i)
        self.seen = self.seen + torch.tensor(counts)
        self.cache.seen_tokens = self.seen

    def kept(self, layer=0):
        """kept[b][h]: sorted live positions."""
        pos = self.cache.layers[layer].meta["pos"]
        return [[sorted(p for p in pos[b, h].tolist() if p != DEAD_POS) for h in range(H)] for b in range(pos.shape[0])]


def std_softmax(part, ref):
    """Eqs. (5)-(8) with loops: part, ref [L, D] -> L scores."""
    L, dims = part.shape
    stds = []
    for t in range(L):
        normed = []
        for c in range(dims):
            lo, hi = min(float(ref[s, c]) for s in range(L)), max(float(ref[s, c]) for s in range(L))
            normed.append((float(part[t, c]) - lo) / (hi - lo))
        mean = sum(normed) / dims
        stds.append(math.sqrt(sum((x - mean) ** 2 for x in normed) / (dims - 1)))
    z = sum(math.exp(s) for s in stds)
    return [math.exp(s) / z for s in stds]


def reference_scores(stream, b, h, S, L, variant):
    """{position: score} for the partitions a compression of row b's full sequence scores now."""
    K, V = stream.kv[b][0][:, h], stream.kv[b][1][:, h]
    n = int(stream.seen[b])
    out = {}
    for u in range((n - S) // L - 1):
        part = slice(S + u * L, S + (u + 1) * L)
        nxt = slice(S + (u + 1) * L, S + (u + 2) * L)
        if variant == "key_norm":
            scores = [-float(K[p].norm()) for p in range(part.start, part.stop)]
        else:
            ref = (lambda Z: Z[part]) if variant == "self" else (lambda Z: Z[nxt])
            sk, sv = std_softmax(K[part], ref(K)), std_softmax(V[part], ref(V))
            scores = [a + c for a, c in zip(sk, sv)]
        out.update(zip(range(part.start, part.stop), scores))
    return out


ROWS = (16, 13)  # S=2, L=4: row 0 compresses partitions 0-1 (window 6), row 1 partition 0 (window 7)


@pytest.mark.parametrize("name,variant", [("lagkv", "next"), ("localkv", "self"), ("lagkv-l2", "key_norm")])
def test_scores_follow_eqs_5_to_9_12_13_14_on_the_partitions_compressed_now(name, variant):
    policy = make_policy(name, sinks=2, lag=4, ratio=0.5)
    stream = Stream(0, ROWS)
    stream.append([16, 13], 16)  # row 1 is left padded by 3
    layer = stream.cache.layers[0]
    scores = policy.scorer.score(layer, stream.seen)
    assert scores.shape == (2, H, layer.capacity)
    for b in range(2):
        for h in range(H):
            expected = reference_scores(stream, b, h, 2, 4, variant)
            assert len(expected) == 4 * ((ROWS[b] - 2) // 4 - 1) > 0
            for slot, p in enumerate(layer.meta["pos"][b, h].tolist()):
                if p in expected:
                    assert float(scores[b, h, slot]) == pytest.approx(expected[p], rel=1e-5, abs=1e-6), (b, h, p)
                else:  # sinks, window, dead: never evicted by this compression
                    assert scores[b, h, slot] == float("inf")


@pytest.mark.parametrize("name,variant", [("lagkv", "next"), ("lagkv-l2", "key_norm")])
def test_select_keeps_the_top_k_of_each_partition_and_everything_else(name, variant):
    S, L, k = 2, 4, 2
    policy = make_policy(name, sinks=S, lag=L, ratio=0.5)
    stream = Stream(1, ROWS)
    stream.append([16, 13], 16)
    layer = stream.cache.layers[0]
    layer.layer_idx = 5  # lagkv-l2 leaves layers 0 and 1 alone
    compress_layer(layer, policy, None, stream.seen)
    kept = stream.kept()
    for b, n in enumerate(ROWS):
        for h in range(H):
            ref = reference_scores(stream, b, h, S, L, variant)
            n_scored = (n - S) // L - 1
            expected = set(range(S)) | set(range(S + n_scored * L, n))
            for u in range(n_scored):
                part = range(S + u * L, S + (u + 1) * L)
                expected |= set(sorted(part, key=lambda p: -ref[p])[:k])
            assert kept[b][h] == sorted(expected)
            assert len(kept[b][h]) == retained(n, S, L, k)
    assert layer.max_len == max(retained(n, S, L, k) for n in ROWS)


@pytest.mark.parametrize("chunk", [1, 2])  # 2 = gcd(S, L): the paper's chunked prefill
def test_recursive_schedule_eq_10_window_frozen_partitions_and_one_shot_equivalence(chunk):
    S, L, k, n_total = 6, 4, 1, 40
    policy = make_policy("lagkv", sinks=S, lag=L, ratio=0.25)
    assert policy.scorer.paper_prefill_chunk == 2
    stream = Stream(2, (n_total, n_total - 6))
    stream.append([chunk, 0], chunk)  # row 1 starts 6 tokens later: left padding
    frozen = [{}, {}]  # row -> {(head, position): event that froze it}; frozen tokens never leave
    events = due_steps = 0
    while int(stream.seen[1]) < n_total - 6:
        behind = int(stream.seen[0]) < 6
        counts = [chunk, max(0, chunk - (6 - int(stream.seen[0])))] if behind else [chunk, chunk]
        stream.append(counts, chunk)
        due = [int(n) >= S + 2 * L and (int(n) - S) % L < chunk for n in stream.seen]
        assert policy.needs_compression(stream.cache, [None]) == any(due)  # exactly when a partition completes
        due_steps += any(due)
        if compress(stream.cache, policy, [None]):
            events += 1
        for b, n in enumerate(stream.seen.tolist()):
            for h in range(H):
                kept = stream.kept()[b][h]
                assert len(kept) == retained(n, S, L, k)
                window = L + (n - S) % L if n >= S + 2 * L else max(0, n - S)
                assert kept[len(kept) - window:] == list(range(n - window, n))  # the sliding window
                for p in kept[S: len(kept) - window]:
                    frozen[b].setdefault((h, p), events)
                assert all(p in kept for (hh, p) in frozen[b] if hh == h)
    # row 0 at n = S + 2L, S + 3L, .. = 14, 18, .., 38; row 1 (6 behind) at 14, .., 34: disjoint steps
    assert events == due_steps == ((n_total - S) // L - 1) + ((n_total - 6 - S) // L - 1)
    one_shot = Stream(2, (n_total, n_total - 6))
    one_shot.append([n_total, n_total - 6], n_total)
    compress_layer(one_shot.cache.layers[0], policy, None, one_shot.seen)
    assert one_shot.kept() == stream.kept()  # a partition's score only needs it and the next one


def test_prefill_then_decode_like_the_engine_compresses_nothing_below_s_plus_2l():
    S, L = 4, 8
    policy = make_policy("lagkv", sinks=S, lag=L, ratio=0.5)
    stream = Stream(3, (30, 30))
    stream.append([S + 2 * L - 1, 5], S + 2 * L - 1)
    drop_dead(stream.cache, headroom=1)
    assert not policy.needs_compression(stream.cache, [None])
    stream.append([1, 1], 1)  # row 0 reaches S + 2L
    assert policy.needs_compression(stream.cache, [None])
    compress(stream.cache, policy, [None])
    kept = stream.kept()
    assert [len(kept[0][h]) for h in range(H)] == [retained(S + 2 * L, S, L, 4)] * H
    assert kept[1] == [list(range(6))] * H  # the short row is untouched


def test_a_foreign_compaction_of_the_same_rows_triggers_a_recheck_finished_rows_do_not():
    S, L = 2, 4
    policy = make_policy("lagkv", sinks=S, lag=L, ratio=0.5)
    stream = Stream(6, (30, 30))
    stream.append([10, 4], 10)  # row 1 still has padding slots
    assert compress(stream.cache, policy, [None])
    stream.append([1, 1], 1)
    assert not policy.needs_compression(stream.cache, [None])  # row 0 needs 3 more tokens
    stream.append([1, 1], 1)
    drop_dead(stream.cache, headroom=1)  # the engine compacts (as after a padded chunked prefill)
    assert policy.needs_compression(stream.cache, [None])  # so LagKV looks again ...
    before = stream.kept()
    compress(stream.cache, policy, [None])
    assert stream.kept() == before  # ... and finds nothing due yet
    stream.cache.select_rows(torch.tensor([0]))  # a row finishing keeps the schedule
    stream.seen = stream.seen[:1]
    stream.kv = stream.kv[:1]
    assert not policy.needs_compression(stream.cache, [None])
    stream.append([1], 1)
    stream.append([1], 1)
    assert policy.needs_compression(stream.cache, [None])  # n = 14 = S + 3L


def test_l2_variant_leaves_the_first_two_layers_whole():
    policy = make_policy("lagkv-l2", sinks=2, lag=4, ratio=0.5)
    stream = Stream(4, (16, 16), layers=4)
    stream.append([16, 16], 16)
    assert compress(stream.cache, policy, [None] * 4)
    for i, layer in enumerate(stream.cache.layers):
        assert (layer.lengths == (16 if i < 2 else retained(16, 2, 4, 2))).all(), i


def test_ratio_one_never_compresses_and_bad_settings_are_rejected():
    stream = Stream(5, (40,))
    stream.append([40], 40)
    assert not make_policy("lagkv", sinks=2, lag=4, ratio=1.0).needs_compression(stream.cache, [None])
    for bad, match in [({"ratio": 0}, "ratio"), ({"lag": 0}, "lag >= 1"), ({"reference": "prev"}, "reference"),
                       ({"statistic": "l1"}, "statistic")]:
        with pytest.raises(ValueError, match=match):
            make_policy("lagkv", **bad)
    with pytest.raises(ValueError, match="no room after 16 sinks"):
        make_policy("lagkv", budget=18).for_horizon(500)


def simulated_peak(S: int, L: int, k: int, n_total: int) -> int:
    """Sec. 2.2's recursion fed one token at a time, counting tokens only: S sinks, then the
    compressed part, then the rest; when the rest reaches 2L tokens ("skip the compression if
    ... less than 2L"), it is cut into partitions of L and every full one but the last keeps k
    tokens (the last plus the modulo stay as the sliding window).  Returns the most tokens held
    at any moment: after a token arrives, before the compression it triggers."""
    compressed = rest = peak = 0
    for n in range(1, n_total + 1):
        rest += n > S
        peak = max(peak, min(n, S) + compressed + rest)
        if rest >= 2 * L:
            done = rest // L - 1
            compressed += done * min(k, L)
            rest -= done * L
    return peak


PAPER_GRID = [(L, r) for L in (128, 512, 1024) for r in (1 / 2, 1 / 4, 1 / 6, 1 / 8)]  # Sec. 3.1, S = 16
# (budget, horizon): 12 pairs below S + 2L = 272 or where the grid cannot use 80% of the budget
# (off the grid), 8 where a Sec. 3.1 setting can; issue 28's case is (128, 700)
FIT_PAIRS = [(64, 100), (64, 200), (100, 700), (128, 300), (128, 700), (128, 1100), (200, 662), (256, 700),
             (256, 1500), (256, 4096), (300, 1000), (400, 900), (512, 662), (512, 1100), (512, 2000), (700, 2000),
             (1000, 4096), (1024, 1100), (2048, 4096), (3000, 8192)]


@pytest.mark.parametrize("budget,horizon", FIT_PAIRS)
def test_budget_fit_peak_uses_80_to_100_percent_of_the_budget_and_stays_in_the_paper_grid_when_it_can(budget, horizon):
    """kvsieve's budget rule, checked by simulating the partition schedule: the peak is within the
    budget and uses at least 80% of it; a Sec. 3.1 (L, r) is chosen whenever one can do that (and
    then the one with the largest rL, Sec. 3.3), and a fit off the grid says so."""
    scorer = make_policy("lagkv", budget=budget).for_horizon(horizon).scorer
    S, L, k = scorer.sinks, scorer.lag, scorer.kept
    assert S == 16 and k == max(1, round(scorer.ratio * L)) and 1 <= k < L
    peak = simulated_peak(S, L, k, horizon)
    assert 0.8 * budget <= peak <= budget, (L, k, peak)
    grid = {(gL, r): max(1, round(r * gL)) for gL, r in PAPER_GRID}
    usable = [gk for (gL, r), gk in grid.items() if 0.8 * budget <= simulated_peak(S, gL, gk, horizon) <= budget]
    on_grid = L in (128, 512, 1024) and any(math.isclose(scorer.ratio, r) for r in (1 / 2, 1 / 4, 1 / 6, 1 / 8))
    assert scorer.in_paper_grid == on_grid == bool(usable)
    if usable:
        assert k == max(usable) and "Sec. 3.1 grid" in scorer.fit_note
    else:
        assert "OFF the paper's grid" in scorer.fit_note
    assert f"peaks at {peak} tokens" in scorer.fit_note


def test_fit_pairs_cover_both_sides_of_the_grid():
    """The 20 pairs exercise the rule on and off the grid (by simulation, not by the fit)."""
    usable = [any(0.8 * b <= simulated_peak(16, L, max(1, round(r * L)), h) <= b for L, r in PAPER_GRID)
              for b, h in FIT_PAIRS]
    assert len(FIT_PAIRS) == 20 and 5 <= usable.count(True) <= 15 and all(h > b for b, h in FIT_PAIRS)


@pytest.mark.parametrize("budget,horizon", [(256, 200), (1000, 700), (5000, 4096)])
def test_budget_fit_at_a_horizon_within_the_budget_compresses_nothing(budget, horizon):
    scorer = make_policy("lagkv", budget=budget).for_horizon(horizon).scorer
    assert simulated_peak(scorer.sinks, scorer.lag, scorer.kept, horizon) == horizon
    assert scorer.ratio == 1 and not scorer.in_paper_grid and "nothing has to go" in scorer.fit_note


def test_budget_fit_that_cannot_stay_within_the_budget_says_so_with_the_smallest_peak():
    budget, horizon = 40, 300
    scorer = make_policy("lagkv", budget=budget).for_horizon(horizon).scorer
    peak = simulated_peak(scorer.sinks, scorer.lag, scorer.kept, horizon)
    smallest = min(simulated_peak(16, L, 1, horizon) for L in range(2, horizon))
    assert scorer.kept == 1 and peak == smallest > budget
    assert not scorer.in_paper_grid and "OVER the budget" in scorer.fit_note and f"{peak} tokens" in scorer.fit_note


def test_hand_settings_are_flagged_against_the_grid_and_the_fit_fields_are_fitted_per_batch():
    assert make_policy("lagkv").scorer.in_paper_grid  # L 128, r 1/4
    assert make_policy("lagkv", lag=1024, ratio=1 / 6).scorer.in_paper_grid
    assert not make_policy("lagkv", lag=32).scorer.in_paper_grid
    assert not make_policy("lagkv", ratio=0.3).scorer.in_paper_grid
    assert not make_policy("lagkv", in_paper_grid=True, lag=64).scorer.in_paper_grid  # derived, never taken
    settings = make_policy("lagkv", budget=128).for_horizon(700).settings()
    assert settings["in_paper_grid"] is False and "OFF the paper's grid" in settings["fit_note"]
    assert {"lag", "ratio", "in_paper_grid", "fit_note"} <= set(LagKV.fitted_fields)  # resume compares the rest
    with pytest.raises(ValueError, match="min_fill"):
        make_policy("lagkv", min_fill=1.5)


# ============================================================================ end to end (bundled model)


@pytest.fixture(scope="module")
def full_run(smollm):
    return generate(*smollm, [SHORT, LONG], None, GenerateConfig(max_new_tokens=24))


def test_nothing_below_s_plus_2l_reproduces_full_greedy(smollm, full_run):
    result = generate(*smollm, [SHORT, LONG], make_policy("lagkv"), GenerateConfig(max_new_tokens=24))
    assert max(s.prompt_tokens for s in result.stats) + 24 < 16 + 2 * 128
    assert result.token_ids == full_run.token_ids
    assert all(s.compression_events == 0 for s in result.stats)


def test_long_row_compresses_without_attention_weights_short_row_is_untouched(smollm, full_run, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("LagKV asked for attention weights")

    monkeypatch.setattr(attention_module, "attention_probs", refuse)
    monkeypatch.setattr(attention_module, "window_attention", refuse)
    S, L, k = 4, 32, 8
    policy = make_policy("lagkv", sinks=S, lag=L, ratio=0.25)
    assert policy.observer() is None and policy.scorer.query_window() == 0
    result = generate(*smollm, [SHORT, LONG], policy, GenerateConfig(max_new_tokens=24, check_every=1))
    fed = [s.prompt_tokens + s.generated_tokens - 1 for s in result.stats]
    assert fed[0] < S + 2 * L <= fed[1]
    assert result.token_ids[0] == full_run.token_ids[0]
    n_kv = smollm[0].config.num_key_value_heads
    assert result.stats[0].final_kv_tokens == [n_kv * fed[0]] * 30
    assert result.stats[1].final_kv_tokens == [n_kv * retained(fed[1], S, L, k)] * 30
    assert result.stats[1].compression_events >= 1


def test_a_fitted_run_on_the_bundled_model_peaks_within_80_to_100_percent_of_the_budget(smollm):
    """The engine's own peak count (every layer, before each compaction) for a budget fit off the
    grid: the prompt (38 tokens) is below the budget, so only the partition schedule sets the peak."""
    budget, new = 64, 40
    result = generate(*smollm, [SHORT], make_policy("lagkv", budget=budget),
                      GenerateConfig(max_new_tokens=new, ignore_eos=True))
    stat, settings = result.stats[0], result.settings
    fed = stat.prompt_tokens + new - 1
    assert stat.prompt_tokens < budget and settings["in_paper_grid"] is False
    S, L = settings["sinks"], settings["lag"]
    expected = simulated_peak(S, L, max(1, round(settings["ratio"] * L)), fed)
    assert 0.8 * budget <= expected <= budget
    n_kv = smollm[0].config.num_key_value_heads
    assert stat.peak_kv_tokens == [n_kv * expected] * len(stat.peak_kv_tokens)
    assert stat.compression_events >= 2
