"""LagKV, LocalKV and LagKV-L2 (arXiv:2504.04704): the score equations recomputed with plain
loops, per-partition selection, the recursive schedule (Eq. 10 lengths, the window of
L + ((n - S) mod L) tokens, frozen partitions, nothing below S + 2L), the budget fit against a
token-by-token simulator of the engine's schedule, and end to end on the bundled SmolLM2 and a
tiny random Llama, whose measured peaks match the simulator."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest
import torch

import kvsieve.attention as attention_module
from kvsieve import GenerateConfig, generate
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.eval.perplexity import score_text
from kvsieve.methods import make_policy
from kvsieve.methods.lagkv import LagKV, peak_tokens, scheduled_peak
from kvsieve.schedule import Feed
from kvsieve import schedule
from kvsieve.schedule import Schedule, compress_layer, drop_dead_layer, observer
from kvsieve.random_models import ByteTokenizer

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
        assert Schedule(policy, stream.cache, 1 << 20).any_due() == any(due)  # exactly when a partition completes
        due_steps += any(due)
        if Schedule(policy, stream.cache, 1 << 20).compress():
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
    [drop_dead_layer(layer, headroom=1) for layer in stream.cache.layers]
    assert not Schedule(policy, stream.cache, 1 << 20).any_due()
    stream.append([1, 1], 1)  # row 0 reaches S + 2L
    assert Schedule(policy, stream.cache, 1 << 20).any_due()
    Schedule(policy, stream.cache, 1 << 20).compress()
    kept = stream.kept()
    assert [len(kept[0][h]) for h in range(H)] == [retained(S + 2 * L, S, L, 4)] * H
    assert kept[1] == [list(range(6))] * H  # the short row is untouched


def test_a_foreign_compaction_of_the_same_rows_triggers_a_recheck_finished_rows_do_not():
    S, L = 2, 4
    policy = make_policy("lagkv", sinks=S, lag=L, ratio=0.5)
    stream = Stream(6, (30, 30))
    stream.append([10, 4], 10)  # row 1 still has padding slots
    assert Schedule(policy, stream.cache, 1 << 20).compress()
    stream.append([1, 1], 1)
    assert not Schedule(policy, stream.cache, 1 << 20).any_due()  # row 0 needs 3 more tokens
    stream.append([1, 1], 1)
    [drop_dead_layer(layer, headroom=1) for layer in stream.cache.layers]  # the engine compacts (as after a padded chunked prefill)
    assert Schedule(policy, stream.cache, 1 << 20).any_due()  # so LagKV looks again ...
    before = stream.kept()
    Schedule(policy, stream.cache, 1 << 20).compress()
    assert stream.kept() == before  # ... and finds nothing due yet
    stream.cache.select_rows(torch.tensor([0]))  # a row finishing keeps the schedule
    stream.seen = stream.seen[:1]
    stream.kv = stream.kv[:1]
    assert not Schedule(policy, stream.cache, 1 << 20).any_due()
    stream.append([1], 1)
    stream.append([1], 1)
    assert Schedule(policy, stream.cache, 1 << 20).any_due()  # n = 14 = S + 3L


def test_l2_variant_leaves_the_first_two_layers_whole():
    policy = make_policy("lagkv-l2", sinks=2, lag=4, ratio=0.5)
    stream = Stream(4, (16, 16), layers=4)
    stream.append([16, 16], 16)
    assert Schedule(policy, stream.cache, 1 << 20).compress()
    for i, layer in enumerate(stream.cache.layers):
        assert (layer.lengths == (16 if i < 2 else retained(16, 2, 4, 2))).all(), i


def test_ratio_one_never_compresses_and_bad_settings_are_rejected():
    stream = Stream(5, (40,))
    stream.append([40], 40)
    assert not Schedule(make_policy("lagkv", sinks=2, lag=4, ratio=1.0), stream.cache, 1 << 20).any_due()
    for bad, match in [({"ratio": 0}, "ratio"), ({"lag": 0}, "lag >= 1"), ({"reference": "prev"}, "reference"),
                       ({"statistic": "l1"}, "statistic")]:
        with pytest.raises(ValueError, match=match):
            make_policy("lagkv", **bad)
    with pytest.raises(ValueError, match="no room after 16 sinks"):
        schedule.fitted(make_policy("lagkv", budget=18), 500)


def simulate(S: int, L: int, k: int, fed: int, prompt: int = 0, pad: int = 0, block: int | None = None,
             interval: int = 1, compress_prefill: bool = True) -> tuple[int, int]:
    """Sec. 2.2's recursion on one row, counting tokens only, with its tokens arriving one at a
    time but compressed only where ``DecodeSession`` checks: after each prefill block of
    ``block`` columns (the row left padded by ``pad`` of them), else once after its ``prompt``
    (at decode step ``interval`` without ``compress_prefill``), then every ``interval`` decode
    steps.  At a check the tokens after the sinks and the compressed part (the rest) are
    compressed only from 2L on ("skip the compression if ... less than 2L"): cut into
    partitions of L, every full one but the last keeps k tokens and is frozen, the last plus
    the modulo stay as the sliding window.  Returns the most tokens held at any moment, and the
    most once the whole prompt's first check is past (0 with blocks: no such wait)."""
    if block is not None:
        ends = range(block, prompt + pad + block, block)
        checks = {max(0, min(end, prompt + pad) - pad) for end in ends}
        wait = 0
    else:
        wait = prompt if compress_prefill else prompt + interval
        checks = {wait}
    checks |= set(range(prompt + interval, fed + 1, interval))
    compressed = rest = peak = after = 0
    for n in range(1, fed + 1):
        rest += n > S
        held = min(n, S) + compressed + rest
        peak = max(peak, held)
        if n > wait:
            after = max(after, held)
        if n in checks and rest >= 2 * L:
            done = rest // L - 1
            compressed += done * min(k, L)
            rest -= done * L
    return peak, after


def one_at_a_time(S: int, L: int, k: int, n_total: int) -> int:
    """The true peak of a row fed one token at a time, each one checked (``simulate``)."""
    return simulate(S, L, k, n_total)[0]


FEEDS = {  # Policy schedule settings -> the engine's checks (kvsieve.policy.Feed)
    "whole prompt": {},
    "interval 3": {"interval": 3},
    "blocks of 16": {"prefill_block": 16},  # gcd(S, L) on the grid: Sec. 3.4's chunks
    "blocks of 5, no prefill compression": {"prefill_block": 5, "compress_prefill": False},
    "prompt left until decode step 2": {"compress_prefill": False, "interval": 2},
}


def rows(prompt: int, horizon: int) -> list[tuple[int, int, int]]:
    """(prompt, left padding, tokens fed) of a batch's longest row and of shorter, padded ones."""
    return [(prompt - d, d, horizon - d) for d in sorted({0, 1, 7, 13, prompt // 3}) if d < prompt]


def simulate_rows(scorer, policy, prompt, horizon) -> list[tuple[int, int, int]]:
    """(prompt, peak, peak after the whole prompt's wait) of every row of ``rows``."""
    S, L, k = scorer.sinks, scorer.lag, scorer.kept
    feed = schedule.feed(policy, prompt)
    return [(p, *simulate(S, L, k, fed, p, pad, feed.block, feed.interval, feed.compress_prefill))
            for p, pad, fed in rows(prompt, horizon)]


def test_scheduled_peak_bounds_every_simulated_row_and_is_exact_one_token_at_a_time():
    """``scheduled_peak`` against the simulator over random small settings and every feed: no
    row, padded or not, shorter prompt or not, holds more once its whole prompt is compressed;
    fed one token at a time (the paper's recursion) it is the true peak."""
    g = random.Random(0)
    for _ in range(400):
        S, L = g.choice([0, 2, 4, 16]), g.randint(2, 9)
        k, horizon = g.randint(1, L), g.randint(1, S + 12 * L)
        prompt = g.randint(1, horizon)
        feed = Feed(prompt=prompt, block=g.choice([None, None, 1, 3, L, 2 * L + 1]), interval=g.randint(1, 4),
                    compress_prefill=g.random() < 0.8)
        bound = scheduled_peak(S, L, k, horizon, feed)
        assert bound >= peak_tokens(S, L, k, horizon)  # a schedule never lowers the one-at-a-time peak
        for p, pad, fed in rows(prompt, horizon):
            peak, after = simulate(S, L, k, fed, p, pad, feed.block, feed.interval, feed.compress_prefill)
            assert after <= bound and peak <= max(bound, feed.held), (S, L, k, horizon, feed, p, pad)
        exact = one_at_a_time(S, L, k, horizon)
        assert scheduled_peak(S, L, k, horizon, Feed()) == exact == peak_tokens(S, L, k, horizon)


PAPER_GRID = [(L, r) for L in (128, 512, 1024) for r in (1 / 2, 1 / 4, 1 / 6, 1 / 8)]  # Sec. 3.1, S = 16
# (budget, horizon): issue 35's 4 x 4 (budgets 64-512 against horizons 300-8000), its (64, 900), and
# budgets below the grid, on it (some filling 80% of the budget, (461, 700) not) and at least the horizon
ISSUE_PAIRS = [(b, h) for b in (64, 128, 256, 512) for h in (300, 700, 2000, 8000)]
FIT_PAIRS = ISSUE_PAIRS + [(64, 900), (64, 100), (100, 700), (200, 662), (300, 1000), (320, 700), (340, 900),
                           (400, 1300), (461, 700), (512, 662), (700, 2000), (1000, 4096), (1024, 1100),
                           (2048, 4096), (3000, 8192), (5000, 4096)]


def smallest_named(err) -> int:
    return int(re.search(r"the smallest budget that fits is (\d+);", str(err)).group(1))


@pytest.mark.parametrize("off_grid", [False, True])
@pytest.mark.parametrize("budget,horizon", FIT_PAIRS)
def test_budget_fit_never_exceeds_the_budget_and_leaves_the_grid_only_when_asked(budget, horizon, off_grid):
    """kvsieve's budget rule against the simulator: a fit's peak, one token at a time, is within
    the budget; a Sec. 3.1 setting is chosen whenever one fits (the one of largest rL among those
    filling 80% of the budget, Sec. 3.3); off the grid only with off_grid; a budget nothing fits
    is refused, naming the smallest budget the simulator says fits."""
    policy = make_policy("lagkv", budget=budget, off_grid=off_grid)
    true_peak = {(L, r): one_at_a_time(16, L, max(1, round(r * L)), horizon) for L, r in PAPER_GRID}
    fits = [max(1, round(r * L)) for (L, r), p in true_peak.items() if p <= budget]
    fills = [max(1, round(r * L)) for (L, r), p in true_peak.items() if 0.8 * budget <= p <= budget]
    try:
        scorer = schedule.fitted(policy, horizon).scorer
    except ValueError as err:
        assert horizon > budget and not fits and "lagkv: budget" in str(err) and "\n" not in str(err)
        least = smallest_named(err)
        if not off_grid:
            assert "set off_grid=true" in str(err) and least == min(horizon, *true_peak.values())
        else:
            assert "even off the paper's grid" in str(err)
            fitted = schedule.fitted(make_policy("lagkv", budget=least, off_grid=True), horizon).scorer
            assert one_at_a_time(16, fitted.lag, fitted.kept, horizon) <= least
        with pytest.raises(ValueError):
            schedule.fitted(make_policy("lagkv", budget=least - 1, off_grid=off_grid), horizon)
        return
    if horizon <= budget:
        assert scorer.ratio == 1 and "nothing has to go" in scorer.fit_note
        return
    S, L, k = scorer.sinks, scorer.lag, scorer.kept
    peak = one_at_a_time(S, L, k, horizon)
    assert S == 16 and 1 <= k < L and peak <= budget and f"peaks at {peak} tokens" in scorer.fit_note
    if fills or (fits and not off_grid):
        assert scorer.in_paper_grid and k == max(fills or fits) and "Sec. 3.1 grid" in scorer.fit_note
        assert ("under 0.8 * budget" in scorer.fit_note) == (not fills)
    else:
        assert off_grid and not scorer.in_paper_grid and "OFF the paper's grid" in scorer.fit_note


def test_fit_pairs_cover_the_grid_below_on_and_within_the_horizon():
    """By simulation, not by the fit: pairs no grid setting fits, pairs where one fills 80% of the
    budget, one where the grid fits without filling it (461, 700), and horizons within the budget."""
    def state(budget, horizon):
        if horizon <= budget:
            return "within"
        peaks = [one_at_a_time(16, L, max(1, round(r * L)), horizon) for L, r in PAPER_GRID]
        if any(0.8 * budget <= p <= budget for p in peaks):
            return "fills"
        return "under-fills" if min(peaks) <= budget else "below"

    counts = Counter(state(*pair) for pair in FIT_PAIRS)
    assert counts["below"] >= 10 and counts["fills"] >= 6 and counts["under-fills"] >= 1 and counts["within"] >= 1


@pytest.mark.parametrize("feed", list(FEEDS))
@pytest.mark.parametrize("budget,horizon", [(64, 900), (128, 700), (340, 900), (461, 700), (512, 2000), (1024, 4096)])
def test_budget_fit_holds_on_every_schedule_for_every_row_of_a_padded_batch(budget, horizon, feed):
    """Prefill blocks (Sec. 3.4), a decode interval, a prompt left until decoding: every row of a
    left-padded batch (shorter prompts, padding shifting where its partitions end within a
    block) stays within the budget once its whole prompt is compressed, and holds no more than
    that prompt before; or the budget is refused, and the one it names fits."""
    prompt = horizon // 3
    for off_grid in (False, True):
        policy = make_policy("lagkv", budget=budget, off_grid=off_grid, **FEEDS[feed])
        try:
            scorer = schedule.fitted(policy, horizon, prompt).scorer
        except ValueError as err:
            least = smallest_named(err)
            policy = make_policy("lagkv", budget=least, off_grid=off_grid, **FEEDS[feed])
            scorer = schedule.fitted(policy, horizon, prompt).scorer
            budget_checked = least
        else:
            budget_checked = budget
        held = schedule.feed(policy, prompt).held
        for p, peak, after in simulate_rows(scorer, policy, prompt, horizon):
            assert after <= budget_checked and peak <= max(budget_checked, held), (off_grid, p, peak, after)
        if held > budget_checked:
            assert f"so the run peaks at {held}, over the budget" in scorer.fit_note


def test_below_the_grid_is_refused_with_the_smallest_budget_that_fits():
    """Issue 35: lagkv@64 at horizon ~900 ran off the grid and over its budget (peak 98)."""
    message = ("lagkv: budget 64 at horizon 900 fits no setting of the paper's grid (Sec. 3.1, S=16); the smallest "
               "budget that fits is 340; raise budget=, or set off_grid=true to fit L and r outside the grid")
    with pytest.raises(ValueError, match=re.escape(message)):
        schedule.fitted(make_policy("lagkv", budget=64), 900)
    with pytest.raises(ValueError, match=re.escape(
            "lagkv: budget 64 at horizon 900 fits no setting even off the paper's grid (one token kept per partition "
            "at least, S=16); the smallest budget that fits is 98; raise budget= or generate fewer tokens")):
        schedule.fitted(make_policy("lagkv", budget=64, off_grid=True), 900)
    assert min(one_at_a_time(16, L, 1, 900) for L in range(2, 443)) == 98  # brute force over every L
    for horizon, least in [(700, 320), (900, 340), (1300, 400)]:  # the smallest grid budgets (module docstring)
        assert schedule.fitted(make_policy("lagkv", budget=least), horizon).scorer.in_paper_grid
        with pytest.raises(ValueError, match=f"the smallest budget that fits is {least};"):
            schedule.fitted(make_policy("lagkv", budget=least - 1), horizon)
    with pytest.raises(ValueError) as err:
        make_policy("lagkv", off_grid="yes")
    assert str(err.value) == "off_grid= must be true or false, got 'yes' (str)"


def test_hand_settings_are_flagged_against_the_grid_and_the_fit_fields_are_fitted_per_batch():
    assert make_policy("lagkv").scorer.in_paper_grid  # L 128, r 1/4
    assert make_policy("lagkv", lag=1024, ratio=1 / 6).scorer.in_paper_grid
    assert not make_policy("lagkv", lag=32).scorer.in_paper_grid
    assert not make_policy("lagkv", ratio=0.3).scorer.in_paper_grid
    assert not make_policy("lagkv", in_paper_grid=True, lag=64).scorer.in_paper_grid  # derived, never taken
    settings = schedule.fitted(make_policy("lagkv", budget=128, off_grid=True), 700).settings()
    assert settings["in_paper_grid"] is False and settings["off_grid"] is True
    assert "OFF the paper's grid" in settings["fit_note"] and "failing regime" in settings["fit_note"]
    assert {"lag", "ratio", "in_paper_grid", "fit_note"} <= set(LagKV.needs.fitted_fields)  # resume compares the rest
    assert "off_grid" not in LagKV.needs.fitted_fields  # a setting of the cell, compared on resume
    with pytest.raises(ValueError, match="min_fill"):
        make_policy("lagkv", min_fill=1.5)



# ============================================================================ end to end (bundled model)


@pytest.fixture(scope="module")
def full_run(full_greedy):
    return full_greedy([SHORT, LONG], 24)


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
    assert observer(policy) is None and policy.scorer.needs.query_window == 0
    result = generate(*smollm, [SHORT, LONG], policy, GenerateConfig(max_new_tokens=24, check_every=1))
    fed = [s.prompt_tokens + s.generated_tokens - 1 for s in result.stats]
    assert fed[0] < S + 2 * L <= fed[1]
    assert result.token_ids[0] == full_run.token_ids[0]
    n_kv = smollm[0].config.num_key_value_heads
    assert result.stats[0].final_kv_tokens == [n_kv * fed[0]] * 30
    assert result.stats[1].final_kv_tokens == [n_kv * retained(fed[1], S, L, k)] * 30
    assert result.stats[1].compression_events >= 1


def test_an_off_grid_fit_on_the_bundled_model_peaks_within_80_to_100_percent_of_the_budget(smollm):
    """The engine's own peak count (every layer, before each compaction) for a budget fit off the
    grid (asked for: 64 is below it): the prompt (38 tokens) is below the budget, so only the
    partition schedule sets the peak."""
    budget, new = 64, 40
    with pytest.raises(ValueError, match="set off_grid=true"):
        generate(*smollm, [SHORT], make_policy("lagkv", budget=budget), GenerateConfig(max_new_tokens=new))
    result = generate(*smollm, [SHORT], make_policy("lagkv", budget=budget, off_grid=True),
                      GenerateConfig(max_new_tokens=new, ignore_eos=True))
    stat, settings = result.stats[0], result.settings
    fed = stat.prompt_tokens + new - 1
    assert stat.prompt_tokens < budget and settings["in_paper_grid"] is False
    S, L = settings["sinks"], settings["lag"]
    expected = one_at_a_time(S, L, max(1, round(settings["ratio"] * L)), fed)
    assert 0.8 * budget <= expected <= budget
    n_kv = smollm[0].config.num_key_value_heads
    assert stat.peak_kv_tokens == [n_kv * expected] * len(stat.peak_kv_tokens)
    assert stat.compression_events >= 2


# ============================================================================ the engine's own peak


@pytest.fixture(scope="module")
def tiny():
    """A two-layer random Llama (2 kv heads) over byte tokens: the engine's bookkeeping, in seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=258, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = ByteTokenizer.eos_token_id
    return model, ByteTokenizer()


# (schedule settings, prompt tokens of a left-padded batch of two, new tokens, budget: None = the
# smallest that fits, read from the refusal of budget 64)
ENGINE_RUNS = {
    "grid, whole prompts": ({}, (120, 70), 580, None),  # horizon 700: L 128, r 1/8 at 320
    "grid, a prompt over the budget": ({}, (400, 200), 300, None),  # the prompt is the peak (fit_note says so)
    "grid, interval 3": ({"interval": 3}, (150, 100), 550, None),
    # row 1's partition falls due 15 tokens before a block ends (padding 17): one token at a time
    # it would peak at 288, here at 288 + 15 = 303, the bound the fit allows for blocks of 16
    "grid, Sec. 3.4 blocks, prompts over the budget": ({"prefill_block": 16}, (440, 423), 20, None),
    "off the grid": ({"off_grid": True}, (40, 25), 300, 96),
}


@pytest.mark.parametrize("run", list(ENGINE_RUNS))
def test_the_engine_peak_per_kv_head_is_the_simulated_one_within_the_budget(tiny, run):
    """``kvsieve.generate``'s measured peak (live tokens per layer, before every compaction and
    prefill block) against the simulator, row by row, for a fitted setting: each row of the
    padded batch peaks exactly where the simulator says, and within the budget once its whole
    prompt is compressed (before that it holds the prompt, as every method does)."""
    model, tok = tiny
    settings, prompts, new, budget = ENGINE_RUNS[run]
    horizon, longest = max(prompts) + new, max(prompts)
    if budget is None:
        with pytest.raises(ValueError) as refused:
            schedule.fitted(make_policy("lagkv", budget=64, **settings), horizon, longest)
        budget = smallest_named(refused.value)
    policy = make_policy("lagkv", budget=budget, **settings)
    config = GenerateConfig(max_new_tokens=new, ignore_eos=True)
    result = generate(model, tok, ["x" * n for n in prompts], policy, config)
    scorer = schedule.fitted(policy, horizon, longest).scorer
    assert result.settings["lag"] == scorer.lag and result.settings["fit_note"] == scorer.fit_note
    assert result.settings["in_paper_grid"] == (not settings.get("off_grid", False))
    feed, n_kv = schedule.feed(policy, longest), model.config.num_key_value_heads
    S, L, k = scorer.sinks, scorer.lag, scorer.kept
    for stat, p in zip(result.stats, prompts):
        assert stat.prompt_tokens == p and stat.generated_tokens == new
        peak, after = simulate(S, L, k, p + new - 1, p, longest - p, feed.block, feed.interval,
                               feed.compress_prefill)  # the last new token is never fed
        assert stat.peak_kv_tokens == [n_kv * peak] * model.config.num_hidden_layers
        assert after <= budget and peak <= max(budget, p)
        if feed.block is not None and p < longest:  # the structural reason the fit allows block - 1 more
            assert peak == budget == peak_tokens(S, L, k, horizon) + feed.block - 1
    if longest > budget and feed.block is None:
        assert f"so the run peaks at {longest}, over the budget" in scorer.fit_note


def test_perplexity_fits_the_budget_too(tiny):
    """``score_text`` (teacher forcing: the first ``budget`` tokens at once, then one at a time)
    fits L and r as ``generate`` does; it ran LagKV's defaults whatever the budget before."""
    model, tok = tiny
    text = "y" * 300
    with pytest.raises(ValueError, match="set off_grid=true"):
        score_text(model, tok, text, make_policy("lagkv", budget=64))
    score = score_text(model, tok, text, make_policy("lagkv", budget=64, off_grid=True))
    assert max(score.peak_kv_tokens) <= 64 * model.config.num_key_value_heads and score.compression_events > 0
