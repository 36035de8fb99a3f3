"""LazyEviction: Algorithm 1's TS/MRI update (Eq. 1), H1, H2 and I_t (Eq. 2) on hand-made
tensors; lagged eviction (Eq. 5) and its schedule; end to end on the bundled SmolLM2."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

from kvsieve import GenerateConfig, generate
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.methods import make_policy
from kvsieve.methods.lazy import LazyEviction, h1_score, h2_score, importance
from kvsieve.policy import compress_layer

gen_module = importlib.import_module("kvsieve.generate")
SHORT = "What is 7 times 8?"  # 38 tokens with SmolLM2's chat template
MEDIUM = "Tell me a story about a fox and a heron."  # 42 tokens
LONG = ("Here is a short story. A fox lived near a river and every morning it walked to the water "
        "to drink. One day it met a heron standing on one leg. Tell me, in two sentences, what the fox said.")  # 77


def sig2(x):
    return 2 / (1 + math.exp(-x))


# ---------------------------------------------------------------------------- helpers
def prefill(meta_init, n, B=1, H=1, D=4):
    cache = SieveCache(1, meta_init=meta_init, grow_chunk=8)
    cache.begin_step(torch.arange(n).expand(B, n))
    cache.update(torch.randn(B, H, n, D), torch.randn(B, H, n, D), 0)
    return cache


def append(cache, pos, D=4):
    B, H = cache.layers[0].lengths.shape
    cache.begin_step(torch.full((B, 1), pos))
    cache.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), 0)


def row(layer, values: dict, G=1):
    """probs [B, H, G, 1, cap] holding values[pos] on the slot of each position."""
    pos = layer.meta["pos"]
    out = torch.zeros(*pos.shape, dtype=torch.float32)
    for p, v in values.items():
        out[pos == p] = v
    return out[:, :, None, None, :].expand(-1, -1, G, -1, -1).clone()


def meta_at(layer, name, p):
    return float(layer.meta[name][layer.meta["pos"] == p][0])


# ---------------------------------------------------------------------------- Eq. (1), Algorithm 1
def test_ts_then_mri_in_algorithm_order_with_mri_from_the_previous_ts():
    scorer = LazyEviction(alpha=0.1)
    cache = prefill(scorer.meta_init, 4)
    layer = cache.layers[0]
    scorer.observe(layer, torch.zeros(1, 1, 1, 4, layer.capacity), torch.arange(4)[None])
    assert layer.meta["ts"][0, 0, :4].tolist() == [0, 1, 2, 3]  # born at their own position
    assert layer.meta["mri"][0, 0, :4].tolist() == [0, 0, 0, 0]

    def step(p, values):
        append(cache, p)
        scorer.observe(layer, row(layer, values), torch.tensor([[p]]))

    step(4, {0: 0.5, 4: 0.5})
    assert meta_at(layer, "ts", 0) == 4 and meta_at(layer, "mri", 0) == 4  # 4 - previous TS 0, not 4 - 4
    assert meta_at(layer, "ts", 4) == 4 and meta_at(layer, "mri", 4) == 0  # attended at birth: gap 0
    step(5, {1: 0.1, 2: 0.0999})  # alpha itself counts (A_t >= alpha), just below does not
    assert (meta_at(layer, "ts", 1), meta_at(layer, "mri", 1)) == (5, 4)
    assert (meta_at(layer, "ts", 2), meta_at(layer, "mri", 2)) == (2, 0)
    step(6, {0: 1.0})
    assert (meta_at(layer, "ts", 0), meta_at(layer, "mri", 0)) == (6, 4)  # max(4, 6 - 4)
    for p in range(7, 13):
        step(p, {})
    step(13, {0: 1.0})
    assert (meta_at(layer, "ts", 0), meta_at(layer, "mri", 0)) == (13, 7)  # max(4, 13 - 6)
    assert (meta_at(layer, "ts", 3), meta_at(layer, "mri", 3)) == (3, 0)  # never attended


def algorithm1_reference(P: torch.Tensor, alpha: float):
    """Plain loops: P[q, k] attention of query q on token k; every query one step."""
    n = P.shape[0]
    ts, mri = list(range(n)), [0] * n
    for q in range(n):
        old = list(ts)
        for k in range(q + 1):
            if P[q, k] >= alpha:
                ts[k] = q
        for k in range(q + 1):
            mri[k] = max(mri[k], ts[k] - old[k])
    return ts, mri


def test_a_prefill_chunk_equals_its_queries_as_single_steps():
    g = torch.Generator().manual_seed(0)
    n, alpha = 9, 0.2
    P = torch.rand(n, n, generator=g).tril() * 0.5  # causal rows
    scorer = LazyEviction(alpha=alpha)
    chunk = prefill(scorer.meta_init, n)
    layer = chunk.layers[0]
    probs = torch.zeros(1, 1, 1, n, layer.capacity)
    probs[0, 0, 0, :, :n] = P
    scorer.observe(layer, probs, torch.arange(n)[None])
    single = prefill(scorer.meta_init, 1)
    for q in range(n):
        if q:
            append(single, q)
        scorer.observe(single.layers[0], row(single.layers[0], {k: float(P[q, k]) for k in range(q + 1)}),
                       torch.tensor([[q]]))
    ts, mri = algorithm1_reference(P, alpha)
    for cache in (chunk, single):
        assert cache.layers[0].meta["ts"][0, 0, :n].tolist() == ts
        assert cache.layers[0].meta["mri"][0, 0, :n].tolist() == mri
    assert max(mri) > 1  # the example has real recurrences


@pytest.mark.parametrize("how,alpha,activated", [("mean", 5e-4, True), ("mean", 6e-4, False),
                                                 ("max", 6e-4, True), ("sum", 1e-3, True), ("sum", 1.2e-3, False)])
def test_gqa_reduction_decides_activation(how, alpha, activated):
    scorer = LazyEviction(alpha=alpha, head_reduction=how)
    cache = prefill(scorer.meta_init, 3)
    layer = cache.layers[0]
    probs = torch.zeros(1, 1, 2, 1, layer.capacity)
    probs[0, 0, :, 0, 0] = torch.tensor([3e-4, 8e-4])  # mean 5.5e-4, max 8e-4, sum 1.1e-3
    scorer.observe(layer, probs, torch.tensor([[2]]))
    assert (meta_at(layer, "ts", 0) == 2) == activated


def test_padding_queries_and_dead_slots_never_activate():
    scorer = LazyEviction(alpha=1e-4)
    cache = SieveCache(1, meta_init=scorer.meta_init)
    qpos = torch.tensor([[DEAD_POS, DEAD_POS, 0, 1]])  # a left-padded row
    cache.begin_step(qpos)
    cache.update(torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4), 0)
    layer = cache.layers[0]
    probs = torch.zeros(1, 1, 1, 4, layer.capacity)
    probs[0, 0, 0, 3, 2:4] = 0.5  # only the real query at position 1 attends
    scorer.observe(layer, probs, qpos)
    assert layer.meta["ts"][0, 0, :4].tolist() == [-1, -1, 1, 1]  # padding slots stay unset
    assert layer.meta["mri"][0, 0, :4].tolist() == [0, 0, 1, 0]


# ---------------------------------------------------------------------------- H1, H2, Eq. (2)
def test_h1_is_two_sigmoid_of_minus_idle_over_mri_with_the_mri_zero_limit():
    idle = torch.tensor([0.0, 5.0, 10.0, 0.0, 3.0])
    mri = torch.tensor([5.0, 5.0, 5.0, 0.0, 0.0])
    expected = [1.0, sig2(-1), sig2(-2), 1.0, 0.0]
    assert h1_score(idle, mri).tolist() == pytest.approx(expected, abs=1e-6)


def test_h2_decreases_with_mri_stays_in_unit_range_and_is_defined_at_zero_and_one():
    mri = torch.arange(0, 2000, dtype=torch.float32)
    for form in ("decreasing", "steep"):
        h2 = h2_score(mri, form)
        assert float(h2[0]) == 0.0 and float(h2[1]) == 1.0
        assert ((h2 >= 0) & (h2 <= 1)).all() and not h2.isnan().any()
        assert (h2[2:] <= h2[1:-1]).all()  # non-increasing from MRI 1 on
    assert (h2_score(mri, "decreasing")[2:] < h2_score(mri, "decreasing")[1:-1]).all()  # strictly
    assert float(h2_score(mri, "decreasing")[-1]) > sig2(-1) - 1e-3  # still ranks large MRIs
    assert h2_score(torch.tensor([2.0, 5.0]), "decreasing").tolist() == pytest.approx([sig2(-0.5), sig2(-0.8)])
    assert h2_score(torch.tensor([2.0, 5.0]), "steep").tolist() == pytest.approx([sig2(-1), sig2(-4)])


def test_printed_h2_is_the_formula_as_printed_rising_with_mri():
    mri = torch.tensor([0.0, 1.0, 2.0, 3.0, 11.0])
    h2 = h2_score(mri, "printed")
    assert h2.tolist() == pytest.approx([0.0, 0.0, sig2(-1), sig2(-0.5), sig2(-0.1)], abs=1e-6)
    assert (h2[2:] > h2[1:-1]).all()  # increasing: the contradiction the default resolves


def test_importance_is_h1_plus_h2_except_h1_alone_at_mri_zero():
    idle = torch.tensor([2.0, 0.0, 4.0])
    mri = torch.tensor([4.0, 0.0, 0.0])
    assert importance(idle, mri).tolist() == pytest.approx([sig2(-0.5) + sig2(-0.75), 1.0, 0.0], abs=1e-6)
    assert importance(idle, mri, "printed")[0] == pytest.approx(sig2(-0.5) + sig2(-1 / 3))


def test_score_reads_t_from_seen_tokens_and_uses_the_stored_state():
    scorer = LazyEviction(h2="steep")
    cache = prefill(scorer.meta_init, 3)
    layer = cache.layers[0]
    layer.meta["ts"][0, 0, :3] = torch.tensor([0.0, 6.0, 9.0])
    layer.meta["mri"][0, 0, :3] = torch.tensor([3.0, 2.0, 0.0])
    scores = scorer.score(layer, torch.tensor([10]))  # t = 9, the last query's position
    assert scores[0, 0, :3].tolist() == pytest.approx([sig2(-3) + sig2(-2), sig2(-1.5) + sig2(-1), 1.0], abs=1e-6)


# ---------------------------------------------------------------------------- Eq. (5) and the schedule
def test_lagged_eviction_keeps_the_w_newest_and_the_top_b_minus_w():
    B_, W = 12, 4
    policy = make_policy("lazy", budget=B_, window=W)
    N = B_ + W
    g = torch.Generator().manual_seed(1)
    cache = prefill(policy.scorer.meta_init, N, B=2, H=2)
    layer = cache.layers[0]
    pos = layer.meta["pos"][..., :N].float()
    layer.meta["ts"][..., :N] = pos + ((N - 1 - pos) * torch.rand(2, 2, N, generator=g)).floor()
    layer.meta["mri"][..., :N] = torch.randint(0, 9, (2, 2, N), generator=g).float()
    imp = importance(N - 1 - layer.meta["ts"][..., :N], layer.meta["mri"][..., :N])
    compress_layer(layer, policy, B_, torch.tensor([N, N]))
    assert (layer.lengths == B_).all() and layer.capacity == B_ + W
    for b in range(2):
        for h in range(2):
            kept = set(layer.meta["pos"][b, h, :B_].tolist())
            assert set(range(N - W, N)) <= kept  # the W most recent
            old_kept = [p for p in kept if p < N - W]
            evicted = [p for p in range(N - W) if p not in kept]
            assert len(old_kept) == B_ - W
            assert min(float(imp[b, h, p]) for p in old_kept) >= max(float(imp[b, h, p]) for p in evicted)


@pytest.mark.parametrize("name", ["lazy", "h2o"])
def test_observation_window_schedule_compresses_every_w_steps_and_peaks_at_b_plus_w(name):
    """Table 3: any scorer with interval=W, recent=W; lazy's defaults are that schedule."""
    B_, W = 12, 4
    policy = make_policy(name, budget=B_, window=W) if name == "lazy" else make_policy(name, budget=B_, interval=W, recent=W)
    assert (policy.interval, policy.recent) == (W, W)
    g = torch.Generator().manual_seed(2)
    cache = prefill(policy.scorer.meta_init, 6, B=2, H=2)
    layer = cache.layers[0]
    peak, compressed_at = 0, []
    for step in range(40):
        p = 6 + step
        append(cache, p)
        visible = layer.live() & (layer.meta["pos"] <= p)
        probs = torch.randn(2, 2, 1, 1, layer.capacity, generator=g).masked_fill(~visible[:, :, None, None], -1e9)
        policy.scorer.observe(layer, probs.softmax(-1), torch.full((2, 1), p))
        peak = max(peak, int(layer.lengths.max()))
        if (step + 1) % policy.interval == 0 and policy.scorer.should_compress(layer, B_):
            compress_layer(layer, policy, B_, torch.full((2,), p + 1))
            assert (layer.lengths == B_).all()
            compressed_at.append(step + 1)
    assert peak == B_ + W
    assert compressed_at and all(s % W == 0 for s in compressed_at)


def test_schedule_defaults_derive_from_window_and_prefill_is_not_compressed():
    policy = make_policy("lazy", budget=100, window=7)
    assert (policy.interval, policy.recent, policy.sinks, policy.compress_prefill) == (7, 7, 0, False)
    assert make_policy("lazy", budget=100).interval == 25  # Table 3 / Table 9
    assert make_policy("lazy", budget=100, compress_prefill=True).compress_prefill is True
    assert make_policy("h2o", budget=100).compress_prefill is True  # other methods keep the engine default


def test_window_at_or_above_budget_is_an_error_naming_both():
    for window in (16, 40):
        with pytest.raises(ValueError, match=rf"W={window}.*B=16"):
            make_policy("lazy", budget=16, window=window)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        make_policy("lazy", budget=16, window=0)


def test_window_auto_reads_the_saved_analysis(tmp_path):
    path = tmp_path / "mri.json"
    with pytest.raises(ValueError, match="kvsieve analyze mri"):
        make_policy("lazy", budget=64, window="auto", analysis=str(path))
    path.write_text(json.dumps({"recommended_window": 19}))
    policy = make_policy("lazy", budget=64, window="auto", analysis=str(path))
    assert (policy.scorer.window, policy.interval, policy.recent) == (19, 19, 19)


def test_alpha_defaults_follow_table_10_by_family_and_can_be_overridden():
    assert LazyEviction().alpha == 1e-4  # family "qwen2"
    assert LazyEviction(family="llama").alpha == 5e-4
    assert LazyEviction(family="qwen3").alpha == 1e-4
    assert LazyEviction(family="llama", alpha=1e-3).alpha == 1e-3
    with pytest.raises(ValueError, match="family must be one of"):
        LazyEviction(family="gpt2")
    with pytest.raises(ValueError, match="alpha must be in"):
        LazyEviction(alpha=0.0)
    with pytest.raises(ValueError, match="lazy h2 must be one of"):
        LazyEviction(h2="rising")


# ---------------------------------------------------------------------------- end to end
def run(smollm, prompts, policy, n):
    model, tok = smollm
    return generate(model, tok, prompts, policy, GenerateConfig(max_new_tokens=n))


def test_budget_at_least_length_reproduces_full_greedy(smollm):
    full = run(smollm, [SHORT, LONG], None, 24)
    lazy = run(smollm, [SHORT, LONG], make_policy("lazy", budget=4096, family="llama"), 24)
    assert lazy.token_ids == full.token_ids
    assert all(s.compression_events == 0 for s in lazy.stats)


def watch_compress(monkeypatch):
    """Record (lengths before, lengths after, seen_tokens, did, slots allocated before) of every
    compression call."""
    calls, original = [], gen_module.compress

    def watched(cache, policy, budgets):
        before = [layer.lengths.clone() for layer in cache.layers]
        capacity = [layer.capacity for layer in cache.layers]
        did = original(cache, policy, budgets)
        calls.append((before, [layer.lengths.clone() for layer in cache.layers], cache.seen_tokens.clone(), did,
                      capacity))
        return did

    monkeypatch.setattr(gen_module, "compress", watched)
    return calls


def test_small_budget_stays_within_b_plus_w_and_drops_to_b(smollm, monkeypatch):
    B_, W = 48, 16
    calls = watch_compress(monkeypatch)
    result = run(smollm, [SHORT, MEDIUM], make_policy("lazy", budget=B_, window=W, family="llama"), 64)
    assert [s.prompt_tokens for s in result.stats] == [38, 42]  # prompts fit the budget
    assert calls and all(did for _, _, _, did, _ in calls)
    prompt = torch.tensor([38, 42])
    for before, after, seen, _, _ in calls:
        assert ((seen - prompt) % W == 0).all()  # only on decode steps t = kW
        assert all((x <= B_ + W).all() for x in before)
        assert all((x == B_).all() for x in after)
    for stat in result.stats:  # peaks at B + W per kv head (3 kv heads), in every layer
        assert stat.peak_kv_tokens == [3 * (B_ + W)] * 30 and stat.compression_events == len(calls)


def test_the_prompt_is_not_compressed_at_prefill(smollm, monkeypatch):
    B_, W = 48, 16
    calls = watch_compress(monkeypatch)
    run(smollm, [LONG], make_policy("lazy", budget=B_, window=W, family="llama"), W + 1)
    assert len(calls) == 1  # the only compression is at decode step W
    before, after, seen, _, capacity = calls[0]
    assert int(seen) == 77 + W
    assert all((x == 77 + W).all() for x in before)  # the 77 prompt tokens were all still there
    assert capacity == [77 + W] * len(capacity)  # room for W appends, not a whole growth chunk
    assert all((x == B_).all() for x in after)
