"""LazyEviction: Algorithm 1's TS/MRI update (Eq. 1) over decoding steps, H1, H2 and I_t (Eq. 2)
on hand-made tensors; lagged eviction (Eq. 5); its schedule and peak end to end on the bundled
SmolLM2."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from kvsieve import GenerateConfig, generate
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.methods import make_policy
from kvsieve.methods._timestamps import threshold
from kvsieve.methods.lazy import LazyEviction, h1_score, h2_score, importance
from kvsieve.methods.raas import RaaS
from kvsieve.schedule import Schedule, compress_layer
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
    cache = prefill(scorer.needs.meta, 4)
    layer = cache.layers[0]
    scorer.observe(layer, torch.zeros(1, 1, 1, 4, layer.capacity), torch.arange(4)[None])
    assert layer.meta["ts"][0, 0, :4].tolist() == [3, 3, 3, 3]  # born at the prefill (step 0: position 3)
    assert layer.meta["mri"][0, 0, :4].tolist() == [0, 0, 0, 0]

    def step(p, values):
        append(cache, p)
        scorer.observe(layer, row(layer, values), torch.tensor([[p]]))

    step(4, {0: 0.5, 4: 0.5})
    assert meta_at(layer, "ts", 0) == 4 and meta_at(layer, "mri", 0) == 1  # 4 - previous TS 3, not 4 - 4
    assert meta_at(layer, "ts", 4) == 4 and meta_at(layer, "mri", 4) == 0  # attended at birth: gap 0
    step(5, {1: 0.1, 2: 0.0999})  # alpha itself counts (A_t >= alpha), just below does not
    assert (meta_at(layer, "ts", 1), meta_at(layer, "mri", 1)) == (5, 2)
    assert (meta_at(layer, "ts", 2), meta_at(layer, "mri", 2)) == (3, 0)
    step(6, {0: 1.0})
    assert (meta_at(layer, "ts", 0), meta_at(layer, "mri", 0)) == (6, 2)  # max(1, 6 - 4)
    for p in range(7, 13):
        step(p, {})
    step(13, {0: 1.0})
    assert (meta_at(layer, "ts", 0), meta_at(layer, "mri", 0)) == (13, 7)  # max(2, 13 - 6)
    assert (meta_at(layer, "ts", 3), meta_at(layer, "mri", 3)) == (3, 0)  # never attended


def algorithm1_reference(P: torch.Tensor, alpha: float, first_step: int = 0, prompt_birth: str = "prefill"):
    """Plain loops: P[q, k] attention of query q on token k; queries from ``first_step`` on are
    steps, each one step; every token starts with MRI 0 and TS = its position, except the tokens
    before ``first_step`` (a prompt whose queries are no steps) with "prefill": TS = first_step - 1."""
    n = P.shape[0]
    ts, mri = [k if k >= first_step or prompt_birth == "position" else first_step - 1 for k in range(n)], [0] * n
    for q in range(first_step, n):
        old = list(ts)
        for k in range(q + 1):
            if P[q, k] >= alpha:
                ts[k] = q
        for k in range(q + 1):
            mri[k] = max(mri[k], ts[k] - old[k])
    return ts, mri


def test_a_prefill_chunk_equals_its_queries_as_single_steps_when_the_prompt_is_observed():
    g = torch.Generator().manual_seed(0)
    n, alpha = 9, 0.2
    P = torch.rand(n, n, generator=g).tril() * 0.5  # causal rows
    scorer = LazyEviction(alpha=alpha, observe_prompt=True)
    chunk = prefill(scorer.needs.meta, n)
    layer = chunk.layers[0]
    probs = torch.zeros(1, 1, 1, n, layer.capacity)
    probs[0, 0, 0, :, :n] = P
    scorer.observe(layer, probs, torch.arange(n)[None])
    single = prefill(scorer.needs.meta, 1)
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


def test_by_default_only_decoding_steps_update_timestamps_as_in_algorithm_1():
    """Sec. 4 / Alg. 1: TS is set to the current *decoding* step; the prompt's queries are no steps."""
    g = torch.Generator().manual_seed(3)
    n, prompt, alpha = 10, 6, 0.2
    P = torch.rand(n, n, generator=g).tril() * 0.5
    scorer = LazyEviction(alpha=alpha)
    assert scorer.observe_prompt is False
    cache = prefill(scorer.needs.meta, prompt)
    layer = cache.layers[0]
    probs = torch.zeros(1, 1, 1, prompt, layer.capacity)
    probs[0, 0, 0, :, :prompt] = P[:prompt, :prompt]
    scorer.observe(layer, probs, torch.arange(prompt)[None])
    assert layer.meta["ts"][0, 0, :prompt].tolist() == [prompt - 1] * prompt  # born at the prefill
    assert layer.meta["mri"][0, 0, :prompt].tolist() == [0] * prompt
    for q in range(prompt, n):
        append(cache, q)
        scorer.observe(layer, row(layer, {k: float(P[q, k]) for k in range(q + 1)}), torch.tensor([[q]]))
    ts, mri = algorithm1_reference(P, alpha, first_step=prompt)
    assert layer.meta["ts"][0, 0, :n].tolist() == ts
    assert layer.meta["mri"][0, 0, :n].tolist() == mri
    assert (ts, mri) != algorithm1_reference(P, alpha)  # observing the prompt would differ here


def alg1_on_decoding_steps(prompt_len: int, steps: list[dict], alpha: float, prompt_birth: str):
    """Alg. 1 lines 1-6 with Eq. 1 on the paper's clock, written from the text alone: decoding step
    t = 1, 2, ... attends with ``steps[t - 1]`` ({token index: attention}); token prompt_len + t - 1
    is generated and appended at step t (TS = t, MRI 0, Sec. 4); a prompt token i is born at the
    prefill, step 0 ("prefill"), or at step i - (prompt_len - 1), its position on this clock
    ("position").  Returns {token: TS} and {token: MRI} after the last step."""
    ts = {i: 0 if prompt_birth == "prefill" else i - (prompt_len - 1) for i in range(prompt_len)}
    mri = dict.fromkeys(ts, 0)
    for t, attention in enumerate(steps, start=1):
        ts[prompt_len + t - 1], mri[prompt_len + t - 1] = t, 0  # the token this step appends
        previous = dict(ts)
        for i in ts:  # lines 1-5
            if attention.get(i, 0.0) >= alpha:
                ts[i] = t
        for i in ts:  # line 6, Eq. (1)
            mri[i] = max(mri[i], ts[i] - previous[i])
    return ts, mri


# Per row of a left-padded batch: prompt length and the attention of each decoding step
# (token index: attention); alpha 0.1.  Prompt token 0 of row 0 is first attended at step 1, as
# an early prompt token often is, and token 2 only at step 2; row 1's prompt is shorter.
DECODING = {0: (6, [{0: 0.5, 6: 0.3}, {2: 0.2}, {}, {0: 0.4, 6: 0.2}, {5: 0.1}, {1: 0.05}, {0: 0.3, 8: 0.9}]),
            1: (4, [{3: 0.3}, {0: 0.2, 4: 0.2}, {}, {}, {0: 0.6, 1: 0.1}, {4: 0.5}, {}])}


@pytest.mark.parametrize("prompt_birth", ["prefill", "position"])
def test_prompt_tokens_first_attended_while_decoding_match_a_decoding_step_simulation(prompt_birth):
    """Issue 35: with the prompt's queries no steps, a prompt token must enter decoding with a TS
    on Alg. 1's clock.  By default ("prefill") it is born at step 0, so its first activation at
    step t records MRI t, like a generated token's (Sec. 4: MRI 0 = "never been activated since
    its generation"); "position" keeps kvsieve's former birth at its own position.  A prompt read
    in two chunks, two rows of different prompt lengths, against the plain simulation above."""
    alpha, n_steps = 0.1, 7
    scorer = LazyEviction(alpha=alpha, prompt_birth=prompt_birth)
    lengths = [DECODING[r][0] for r in (0, 1)]
    width = max(lengths)
    prompt_pos = torch.tensor([[p - (width - n) if p >= width - n else DEAD_POS for p in range(width)] for n in lengths])
    cache = SieveCache(1, meta_init=scorer.needs.meta)
    layer = None
    for chunk in (slice(0, 4), slice(4, width)):  # prefill chunks: their attention is no step
        qpos = prompt_pos[:, chunk]
        cache.begin_step(qpos)
        cache.update(torch.randn(2, 1, qpos.shape[1], 4), torch.randn(2, 1, qpos.shape[1], 4), 0)
        layer = cache.layers[0]
        scorer.observe(layer, torch.rand(2, 1, 1, qpos.shape[1], layer.capacity) * (qpos != DEAD_POS)[:, None, None, :, None],
                       qpos)
    for t in range(1, n_steps + 1):
        qpos = torch.tensor([[n + t - 1] for n in lengths])
        cache.begin_step(qpos)
        cache.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4), 0)
        probs = torch.zeros(2, 1, 1, 1, layer.capacity)
        for r in (0, 1):
            for i, a in DECODING[r][1][t - 1].items():
                probs[r, 0, 0, 0, layer.meta["pos"][r, 0] == i] = a
        scorer.observe(layer, probs, qpos)
    for r in (0, 1):
        n, steps = DECODING[r]
        ts, mri = alg1_on_decoding_steps(n, steps, alpha, prompt_birth)
        pos = layer.meta["pos"][r, 0]
        got_ts = {int(p): float(x) - (n - 1) for p, x in zip(pos, layer.meta["ts"][r, 0]) if p != DEAD_POS}
        got_mri = {int(p): float(x) for p, x in zip(pos, layer.meta["mri"][r, 0]) if p != DEAD_POS}
        assert got_ts == ts and got_mri == mri  # TS on the engine's clock: decoding step t is position n + t - 1
    # the two readings differ on prompt tokens first attended while decoding, and only there
    ts, new = alg1_on_decoding_steps(6, DECODING[0][1], alpha, "prefill")
    _, old = alg1_on_decoding_steps(6, DECODING[0][1], alpha, "position")
    assert (new[0], new[2], old[0], old[2]) == (3, 2, 6, 5)
    assert {i for i in new if new[i] != old[i]} == {0, 2}  # the last prompt token (5) is born at step 0 in both


def test_prompt_birth_is_a_checked_setting_recorded_in_the_policy():
    assert LazyEviction().prompt_birth == "prefill"
    assert make_policy("lazy", budget=64, prompt_birth="position").settings()["prompt_birth"] == "position"
    with pytest.raises(ValueError, match=r"lazy prompt_birth must be one of \['prefill', 'position'\]"):
        LazyEviction(prompt_birth="first-activation")


@pytest.mark.parametrize("how,alpha,activated", [("mean", 5e-4, True), ("mean", 6e-4, False),
                                                 ("max", 6e-4, True), ("sum", 1e-3, True), ("sum", 1.2e-3, False)])
def test_gqa_reduction_decides_activation(how, alpha, activated):
    scorer = LazyEviction(alpha=alpha, head_reduction=how)
    cache = prefill(scorer.needs.meta, 3)
    layer = cache.layers[0]
    probs = torch.zeros(1, 1, 2, 1, layer.capacity)
    probs[0, 0, :, 0, 0] = torch.tensor([3e-4, 8e-4])  # mean 5.5e-4, max 8e-4, sum 1.1e-3
    scorer.observe(layer, probs, torch.tensor([[2]]))
    assert (meta_at(layer, "ts", 0) == 2) == activated


def test_padding_queries_and_dead_slots_never_activate():
    scorer = LazyEviction(alpha=1e-4, observe_prompt=True)  # a multi-query (prefill) call that is observed
    cache = SieveCache(1, meta_init=scorer.needs.meta)
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


def test_default_h2_falls_with_mri_as_the_text_says_and_is_the_printed_formula_without_its_reciprocal():
    """Sec. 4: "tokens with smaller MRI values have a higher possibility to be important"; App. D:
    the score is monotonically decreasing with values in [0, 1]; "H2 = 0 if MRI = 0".  The printed
    2 sigma(-1/(MRI - 1)) with the reciprocal dropped is 2 sigma(-(MRI - 1)), here from math.exp."""
    assert LazyEviction().h2 == "text"
    mri = torch.arange(0, 61, dtype=torch.float32)
    h2 = h2_score(mri)
    assert float(h2[0]) == 0.0
    assert (h2[2:] < h2[1:-1]).all()  # strictly falling from MRI 1 on
    assert ((h2 >= 0) & (h2 <= 1)).all()
    expected = [0.0] + [2 / (1 + math.exp(m - 1)) for m in range(1, 61)]
    assert h2.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-30)
    # the sign flip alone, 2 sigma(1/(MRI - 1)), also falls but leaves App. D's [0, 1]
    assert all(2 / (1 + math.exp(-1 / (m - 1))) > 1 for m in range(2, 61))


def test_printed_h2_equals_the_equation_as_printed_and_rises_with_mri():
    mri = torch.tensor([0.0, 2.0, 3.0, 5.0, 11.0, 100.0])
    h2 = h2_score(mri, "printed")
    printed = [0.0] + [2 / (1 + math.exp(-(-1 / (m - 1)))) for m in (2, 3, 5, 11, 100)]  # 2 sigma(-1/(MRI-1))
    assert h2.tolist() == pytest.approx(printed, rel=1e-6)
    assert (h2[2:] > h2[1:-1]).all()  # rising: the contradiction the default resolves
    assert float(h2_score(torch.tensor([1.0]), "printed")) == 0.0  # undefined; the limit MRI -> 1+


def test_scaled_h2_is_kvsieves_own_falling_form_and_old_names_point_to_the_new_ones():
    mri = torch.arange(1, 2001, dtype=torch.float32)
    h2 = h2_score(mri, "scaled")
    assert h2.tolist() == pytest.approx([2 / (1 + math.exp((m - 1) / m)) for m in range(1, 2001)], rel=1e-5)
    assert (h2[1:] < h2[:-1]).all() and float(h2[-1]) > 2 / (1 + math.e) - 1e-3
    for old, new in (("decreasing", "scaled"), ("steep", "text")):
        with pytest.raises(ValueError, match=f"'{old}' is now '{new}'"):
            LazyEviction(h2=old)
        with pytest.raises(ValueError, match=f"'{old}' is now '{new}'"):
            h2_score(mri, old)


def test_importance_is_h1_plus_h2_except_h1_alone_at_mri_zero():
    idle = torch.tensor([2.0, 0.0, 4.0])
    mri = torch.tensor([4.0, 0.0, 0.0])
    assert importance(idle, mri).tolist() == pytest.approx([sig2(-0.5) + sig2(-3), 1.0, 0.0], abs=1e-6)
    assert importance(idle, mri, "printed")[0] == pytest.approx(sig2(-0.5) + sig2(-1 / 3))


def test_score_reads_t_from_seen_tokens_and_uses_the_stored_state():
    scorer = LazyEviction()
    cache = prefill(scorer.needs.meta, 3)
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
    cache = prefill(policy.scorer.needs.meta, N, B=2, H=2)
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


def test_schedule_defaults_derive_from_window_and_prefill_is_not_compressed():
    policy = make_policy("lazy", budget=100, window=7)
    assert (policy.interval, policy.recent, policy.sinks, policy.compress_prefill) == (7, 7, 0, False)
    assert make_policy("lazy", budget=100).interval == 25  # Table 3 / Table 9
    assert make_policy("lazy", budget=100, compress_prefill=True).compress_prefill is True
    assert make_policy("h2o", budget=100).compress_prefill is True  # other methods keep the engine default


@pytest.mark.parametrize("W", [1, 4, 7, 25])
def test_the_interval_is_w_at_every_budget_and_a_budget_below_2w_is_refused(W):
    """Alg. 1 line 8: eviction at t = kW, the same W as Eq. 5's recent window.  kvsieve caps a
    default interval at B // 2 (issue 28), which below B = 2W would make it smaller than W (issue
    35): such budgets are refused with one line naming both fixes, never run with another interval."""
    for budget in range(2 * W, 2 * W + 40):
        policy = make_policy("lazy", budget=budget, window=W)
        assert (policy.interval, policy.recent) == (W, W)
        assert policy.settings()["interval"] == W == policy.settings()["window"]
        assert policy.interval <= budget // 2  # the budget stays a bound: peak B + W <= 1.5 B
    for budget in range(2 * W - 1, 0, -1):
        with pytest.raises(ValueError) as err:
            make_policy("lazy", budget=budget, window=W)
        message = str(err.value)
        assert "\n" not in message
        assert f"window W={W} needs budget >= 2W={2 * W}" in message and f"B={budget}" in message
        assert f"raise budget= to {2 * W}" in message
        assert (f"set window={budget // 2}" in message) == (budget >= 2)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        make_policy("lazy", budget=16, window=0)


def test_an_explicit_interval_other_than_w_is_kept_as_a_recorded_deviation():
    """Policy keeps an explicit interval as given (a documented deviation from Alg. 1's one W);
    the recent window stays W, and a W at or above the budget is still refused."""
    policy = make_policy("lazy", budget=100, window=10, interval=4)
    assert (policy.interval, policy.recent, policy.scorer.window) == (4, 10, 10)
    assert policy.settings()["interval"] == 4 and policy.settings()["window"] == 10
    assert make_policy("lazy", budget=30, interval=10).interval == 10  # B < 2W: the interval is the user's
    with pytest.raises(ValueError, match=r"W=25 must be smaller than the budget B=20"):
        make_policy("lazy", budget=20, interval=10)
    assert make_policy("caote:lazy", budget=64).interval == 1  # a wrapper's own schedule (CAOTE: every step)


def test_window_auto_reads_the_saved_analysis(tmp_path):
    path = tmp_path / "mri.json"
    with pytest.raises(ValueError, match="kvsieve analyze mri"):
        make_policy("lazy", budget=64, window="auto", analysis=str(path))
    path.write_text(json.dumps({"recommended_window": 19}))
    policy = make_policy("lazy", budget=64, window="auto", analysis=str(path))
    assert (policy.scorer.window, policy.interval, policy.recent) == (19, 19, 19)


def test_alpha_defaults_follow_table_10_by_family_and_can_be_overridden():
    assert LazyEviction(family="llama").alpha == 5e-4
    assert LazyEviction(family="qwen3").alpha == 1e-4
    assert LazyEviction(family="llama", alpha=1e-3).alpha == 1e-3
    with pytest.raises(ValueError, match="family must be 'auto' or one of"):
        LazyEviction(family="gpt2")
    with pytest.raises(ValueError, match="alpha must be in"):
        LazyEviction(alpha=0.0)
    with pytest.raises(ValueError, match="lazy h2 must be one of"):
        LazyEviction(h2="rising")


@pytest.mark.parametrize("scorer_class", [LazyEviction, RaaS])
def test_by_default_alpha_is_the_table_10_value_of_the_models_own_family(scorer_class):
    """App. C sets alpha per model: 5e-4 for the Llama model, 1e-4 for the Qwen ones.  With
    ``family="auto"`` (the default) each generate call reads the model's type; a type Table 10
    has no value for is refused naming the settings that fix it; an explicit alpha wins."""
    def model(model_type):
        return SimpleNamespace(config=SimpleNamespace(model_type=model_type))

    scorer = scorer_class()
    assert scorer.family == "auto" and scorer.alpha is None
    for model_type, alpha in (("llama", 5e-4), ("qwen2", 1e-4), ("qwen3", 1e-4)):
        with scorer.attach(model(model_type), None):
            assert threshold(scorer) == alpha
    with pytest.raises(RuntimeError, match="set family or alpha"):
        threshold(scorer)  # outside a call nothing says which model it runs on
    with pytest.raises(ValueError, match="no alpha for model type 'gpt2'; set family= to one of"):
        with scorer.attach(model("gpt2"), None):
            pass
    explicit = scorer_class(alpha=2e-3)
    with explicit.attach(model("llama"), None):
        assert threshold(explicit) == 2e-3


# ---------------------------------------------------------------------------- end to end
def run(smollm, prompts, policy, n):
    model, tok = smollm
    return generate(model, tok, prompts, policy, GenerateConfig(max_new_tokens=n))


# a budget at least the length reproduces full greedy: tests/test_generate.py::test_budget_at_least_length_reproduces_full


@pytest.mark.parametrize("name", ["lazy", "raas"])
def test_on_the_bundled_llama_family_model_the_default_runs_at_the_llama_alpha(smollm, name):
    """SmolLM2 is a Llama model (``model_type`` "llama"): the default ``family="auto"`` decodes
    token for token as App. C's Llama setting (alpha 5e-4), and the settings record says it ran
    with the family read from the model."""
    settings = {"window": 8} if name == "lazy" else {}
    default = run(smollm, [LONG], make_policy(name, budget=40, **settings), 48)
    llama = run(smollm, [LONG], make_policy(name, budget=40, alpha=5e-4, **settings), 48)
    qwen = run(smollm, [LONG], make_policy(name, budget=40, family="qwen2", **settings), 48)
    assert default.token_ids == llama.token_ids != qwen.token_ids  # the Qwen value (the old default) differs here
    assert (default.settings["family"], default.settings["alpha"]) == ("auto", None)


def watch_compress(monkeypatch):
    """Record (lengths before, lengths after, seen_tokens, did, slots allocated before) of every
    cache-wide compression the engine runs (``Schedule.compress``)."""
    calls, original = [], Schedule.compress

    def watched(schedule):
        cache = schedule.store
        before = [layer.lengths.clone() for layer in cache.layers]
        capacity = [layer.capacity for layer in cache.layers]
        did = original(schedule)
        calls.append((before, [layer.lengths.clone() for layer in cache.layers], cache.seen_tokens.clone(), did,
                      capacity))
        return did

    monkeypatch.setattr(Schedule, "compress", watched)
    return calls


@pytest.mark.parametrize("name", ["lazy", "h2o"])
def test_compressions_fall_exactly_on_decoding_steps_kw_while_the_cache_exceeds_b(smollm, monkeypatch, name):
    """Alg. 1 line 8 (evict at t = kW, only while |K| > B) and Eq. 5 (down to B, the cache peaking
    at B + W, Fig. 6) for lazy and for Table 3's H2O "+ window" (interval W, recent W), against a
    replay of that rule on the rows' lengths: each decoding step adds one token to each row."""
    B_, W, new = 52, 8, 30
    policy = (make_policy("lazy", budget=B_, window=W, family="llama") if name == "lazy"
              else make_policy("h2o", budget=B_, interval=W, recent=W))
    calls = watch_compress(monkeypatch)
    model, tok = smollm
    result = generate(model, tok, [SHORT, MEDIUM], policy, GenerateConfig(max_new_tokens=new, ignore_eos=True))
    prompt = [s.prompt_tokens for s in result.stats]
    assert prompt == [38, 42]  # both below B: only decoding steps can trigger an eviction
    lengths, expected = list(prompt), []
    for t in range(1, new):  # new - 1 decoding steps feed the sampled tokens back
        lengths = [n + 1 for n in lengths]
        if t % W == 0 and max(lengths) > B_:
            expected.append(t)
            lengths = [min(n, B_) for n in lengths]
    assert expected == [16, 24]  # t = 8 is skipped (|K| = 50 <= B); the row over B at t = 11 waits for 16
    done = [(after, seen) for _, after, seen, did, _ in calls if did]
    assert [(seen - torch.tensor(prompt)).tolist() for _, seen in done] == [[t, t] for t in expected]
    assert all((x == B_).all() for after, _ in done for x in after)  # every layer, row and kv head at B
    n_kv = model.config.num_key_value_heads
    for stat in result.stats:
        assert stat.compression_events == len(expected)
        assert stat.peak_kv_tokens == [n_kv * (B_ + W)] * model.config.num_hidden_layers


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
