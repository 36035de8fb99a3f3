"""CAOTE and FastCAOTE: the score equals the true change of the attention output when a token
is evicted and the rest renormalised (Thm. 3.2, GQA heads by App. B.2), Eqs. 20-22 on other
bases, the ``<prefix>:<base>`` wrapper keeps the base's behaviour otherwise, and end to end
on the bundled SmolLM2 (budget >= length is exact; block-wise prefill stays within budget)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvsieve import GenerateConfig, generate
from kvsieve.attention import StepState, sieve_attention
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.methods import WRAPPERS, describe_methods, make_policy
from kvsieve.methods.caote import caote_errors
from kvsieve.methods.tova import TOVA
from kvsieve.policy import indices_from_mask

gen_module = importlib.import_module("kvsieve.generate")
B, H, G, D = 2, 2, 3, 8
HQ = H * G
SCALE = 0.4
CAOTE_BLOCK = WRAPPERS["caote"].prefill_chunk  # 128, Sec. 4.1
SHORT = "What is 7 times 8?"
LONG = ("Here is a short story. A fox lived near a river and every morning it walked to the water "
        "to drink. One day it met a heron standing on one leg. Tell me, in two sentences, what the fox said.")


def attend(cache, g, qpos_rows, observer=None):
    qpos = torch.tensor(qpos_rows)
    T = qpos.shape[1]
    q = torch.randn(B, HQ, T, D, generator=g) * 2
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    cache.begin_step(qpos)
    key, value = cache.update(k, v, 0)
    sieve_attention(SimpleNamespace(layer_idx=0), q, key, value, scaling=SCALE, kvsieve=StepState(cache, qpos, observer))


def decode_cache(seed, ragged=True, meta_init=None, observer=None):
    """10 prompt tokens (row 1 left padded by 2), then, if ``ragged``, each head keeps its own
    random subset (dead slots at the ends), then one decode step; queries are recorded."""
    g = torch.Generator().manual_seed(seed)
    cache = SieveCache(1, meta_init=meta_init, grow_chunk=4)
    layer = cache.layers[0]
    layer.query_window = 4
    attend(cache, g, [list(range(10)), [DEAD_POS] * 2 + list(range(8))], observer)
    if ragged:
        keep = torch.zeros(B, H, layer.capacity, dtype=torch.bool)
        for b, counts in enumerate(((7, 5), (6, 8))):
            live = torch.nonzero(layer.live()[b, 0]).flatten()
            for h, n in enumerate(counts):
                keep[b, h, live[torch.randperm(len(live), generator=g)[:n]]] = True
        K = int(keep.sum(-1).max())
        kept_idx, lengths = indices_from_mask(keep, K)
        layer.compact(kept_idx, lengths, capacity=K + 1, max_len=K)
    attend(cache, g, [[10], [8]], observer)
    return layer, torch.tensor([11, 9])


def output(weights, values):
    return weights @ values


def true_change(layer, b, h):
    """{slot: ||concatenated output change of the group's query heads||} when the slot's token
    is evicted and the last query's softmax renormalised over the rest, by brute force."""
    slots = [s for s in range(layer.capacity) if layer.meta["pos"][b, h, s] != DEAD_POS]
    keys, values = layer.keys[b, h, slots], layer.values[b, h, slots]
    change = {}
    for j, slot in enumerate(slots):
        rest = [i for i in range(len(slots)) if i != j]
        total = 0.0
        for hq in range(h * G, (h + 1) * G):
            logits = keys @ layer.recent_queries[b, hq, -1] * SCALE
            before = output(logits.softmax(0), values)
            after = output(logits[rest].softmax(0), values[rest])
            total += float((before - after).square().sum())
        change[slot] = total ** 0.5
    return change


def test_score_equals_the_true_output_change_of_evicting_one_token():
    """Thm. 3.2 per query head, App. B.2 over a GQA group: exact for TOVA's per-head scores."""
    layer, seen = decode_cache(0)
    scores = make_policy("caote:tova", budget=4, heads="group").scorer.score(layer, seen)
    assert scores.shape == (B, H, layer.capacity)
    for b in range(B):
        for h in range(H):
            change = true_change(layer, b, h)
            assert len(change) == int(layer.lengths[b, h]) >= 5
            for slot, expected in change.items():
                assert float(scores[b, h, slot]) == pytest.approx(expected, rel=1e-4, abs=1e-6)
            least = min(change, key=change.get)
            assert least == min(change, key=lambda s: float(scores[b, h, s]))  # evicted first


@pytest.mark.parametrize("base,settings", [("tova", {"heads": "group"}), ("snapkv", {"window": 4})])
def test_per_query_head_base_scores_average_back_to_the_bases_own_score(base, settings):
    policy = make_policy(f"caote:{base}", budget=8, **settings)
    layer, seen = decode_cache(5, meta_init=policy.scorer.meta_init, observer=policy.observer())
    per_head = policy.scorer.base_scores(layer, seen)  # [B, H, G, cap], one row per query head
    assert per_head.shape == (B, H, G, layer.capacity)
    live = layer.live()[:, :, None].expand_as(per_head)
    # both bases average their group (SnapKV's avg pooling is linear), so the means agree
    own = make_policy(base, budget=8, **settings).scorer.score(layer, seen)
    assert torch.allclose(per_head.mean(dim=2)[live[:, :, 0]], own[live[:, :, 0]], rtol=1e-5, atol=1e-7)
    if base == "tova":  # and each query head's score is that head's own attention row
        for b in range(B):
            for hq in range(HQ):
                h, g = divmod(hq, G)
                row = (layer.keys[b, h] @ layer.recent_queries[b, hq, -1] * SCALE).masked_fill(
                    ~layer.live()[b, h], float("-inf")).softmax(0)
                assert torch.allclose(per_head[b, h, g][layer.live()[b, h]], row[layer.live()[b, h]], atol=1e-6)


@pytest.mark.parametrize("heads", ["layer", "group"])
def test_tova_per_query_head_scores_are_each_heads_attention_row_or_their_layer_mean(heads):
    """Group mode: each query head's own row ([B, H, G, cap], recomputed from the last query).
    Layer mode: the layer mean, read from the state observed in the forward pass ([B, H, 1, cap])."""
    policy = make_policy("tova", budget=8, heads=heads)
    layer, seen = decode_cache(6, ragged=heads == "group", meta_init=policy.scorer.meta_init,
                               observer=policy.observer())  # layer mode: every head holds the same tokens
    fast = policy.scorer.score_per_query_head(layer, seen)
    assert fast.shape[2] == (G if heads == "group" else 1)
    live = layer.live()
    for b in range(B):
        rows = torch.stack([(layer.keys[b, hq // G] @ layer.recent_queries[b, hq, -1] * SCALE).masked_fill(
            ~live[b, hq // G], float("-inf")).softmax(0) for hq in range(HQ)]).view(H, G, -1)
        want = rows if heads == "group" else rows.mean(dim=(0, 1), keepdim=True)[0].expand(H, 1, -1)
        for h in range(H):
            assert torch.allclose(fast[b, h][:, live[b, h]], want[h][:, live[b, h]], atol=1e-6)


def test_fastcaote_replaces_the_output_by_the_mean_value_eq_22():
    layer, seen = decode_cache(1)
    scores = make_policy("fastcaote:tova", budget=4, heads="group").scorer.score(layer, seen)
    for b in range(B):
        for h in range(H):
            slots = [s for s in range(layer.capacity) if layer.meta["pos"][b, h, s] != DEAD_POS]
            keys, values = layer.keys[b, h, slots], layer.values[b, h, slots]
            mean = values.mean(0)
            weights = [(keys @ layer.recent_queries[b, hq, -1] * SCALE).softmax(0) for hq in range(h * G, (h + 1) * G)]
            for j, slot in enumerate(slots):
                per_head = [float(a[j] / (1 - a[j]) * (mean - values[j]).norm()) for a in weights]
                assert float(scores[b, h, slot]) == pytest.approx(sum(e * e for e in per_head) ** 0.5, rel=1e-4)


def test_h2o_scores_are_normalised_by_their_sum_eq_21():
    policy = make_policy("caote:h2o", budget=4)
    layer, seen = decode_cache(2, meta_init=policy.scorer.meta_init)
    layer.meta["acc"] = torch.rand(layer.meta["acc"].shape, generator=torch.Generator().manual_seed(3)) * 5
    scores = policy.scorer.score(layer, seen)
    for b in range(B):
        for h in range(H):
            slots = [s for s in range(layer.capacity) if layer.meta["pos"][b, h, s] != DEAD_POS]
            acc, values = layer.meta["acc"][b, h, slots], layer.values[b, h, slots]
            hn = acc / acc.sum()  # Eq. (21); sum h > 1 for H2O (Thm. B.1)
            out = hn @ values
            for j, slot in enumerate(slots):
                expected = float(hn[j] / (1 - hn[j]) * (out - values[j]).norm())  # Eq. (20)
                assert float(scores[b, h, slot]) == pytest.approx(expected, rel=1e-4)


def test_layer_averaged_tova_gives_one_score_per_layer_from_every_heads_change():
    policy = make_policy("caote:tova", budget=4)
    layer, seen = decode_cache(4, ragged=False, meta_init=policy.scorer.meta_init,
                               observer=policy.observer())  # TOVA's layer average needs aligned heads
    assert policy.scorer.needs_aligned_heads()
    scores = policy.scorer.score(layer, seen)
    probs = torch.stack([(layer.keys[b, hq // G] @ layer.recent_queries[b, hq, -1] * SCALE)
                         .masked_fill(layer.meta["pos"][b, hq // G] == DEAD_POS, float("-inf")).softmax(0)
                         for b in range(B) for hq in range(HQ)]).view(B, HQ, -1)
    a = probs.mean(dim=1)  # [B, cap]: TOVA's score, the same for every head
    live = layer.live()
    errors = caote_errors(a[:, None, None].expand(B, H, 1, -1), layer.values, live)  # [B, H, 1, cap]
    expected = (G * errors.square().sum(dim=(1, 2))).sqrt()  # every query head of the layer
    for h in range(H):
        assert torch.allclose(scores[:, h][live[:, h]], expected[live[:, h]], rtol=1e-4)


@pytest.mark.parametrize("method,settings", [("caote:h2o", {}), ("caote:tova", {"heads": "group"}), ("fastcaote:h2o", {})])
def test_output_from_the_attention_pass_gives_the_same_scores(method, settings):
    """CAOTE's observe hands h (Eq. 21; FastCAOTE: uniform weights, Eq. 22) to the decode step's
    attention pass, which returns o = h V (Eq. 20) and o.v_j with its own output; scores from
    them equal scores recomputed at compression, and any change to the store drops them."""
    policy = make_policy(method, budget=4, **settings)
    layer, seen = decode_cache(7, meta_init=policy.scorer.meta_init, observer=policy.observer())
    h, out, dots = layer.step_results["value_mix"]
    assert h.shape[:2] == (B, H) and h.shape[-1] == layer.capacity
    if method.startswith("fast"):  # uniform weights: the mean of the live values (Eq. 22)
        live = layer.live()
        mean = (layer.values * live[..., None]).sum(dim=2) / live.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(out[:, :, 0], mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, h @ layer.values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dots, out @ layer.values.transpose(-1, -2), rtol=1e-5, atol=1e-6)
    fused = policy.scorer.score(layer, seen)
    layer.step_results.clear()
    torch.testing.assert_close(fused, policy.scorer.score(layer, seen), rtol=1e-5, atol=1e-6)
    layer.step_results["value_mix"] = (h, out, dots)
    layer.evict(torch.zeros(B, H, 1, dtype=torch.long), torch.ones(B, H, dtype=torch.long), layer.max_len)
    assert not layer.step_results


def test_negative_base_scores_are_shifted_then_normalised_keeping_their_order():
    scores = torch.tensor([[[[-3.0, -1.0, -2.0, 5.0]]]])  # [1, 1, 1, 4], last slot dead
    live = torch.tensor([[[True, True, True, False]]])
    values = torch.tensor([[[[0.0, 0.0], [2.0, 0.0], [0.0, 1.0], [9.0, 9.0]]]])
    errors = caote_errors(scores, values, live)[0, 0, 0]
    hn = torch.tensor([0.0, 2.0, 1.0]) / 3  # shift by the minimum -3, divide by the sum
    out = hn @ values[0, 0, :3]
    expected = [float(hn[j] / (1 - hn[j]) * (out - values[0, 0, j]).norm()) for j in range(3)]
    assert errors[:3].tolist() == pytest.approx(expected, rel=1e-6)
    assert errors[0] == 0  # the base's lowest keeps zero weight


def test_wrapper_keeps_the_base_schedule_state_and_settings():
    base, wrapped = make_policy("h2o", budget=64), make_policy("caote:h2o", budget=64)
    assert wrapped.name == wrapped.settings()["method"] == "caote:h2o"
    assert (wrapped.sinks, wrapped.recent, wrapped.interval) == (base.sinks, base.recent, base.interval) == (0, 32, 1)
    assert wrapped.scorer.meta_init == base.scorer.meta_init and wrapped.scorer.observes
    assert wrapped.prefill_block and not base.prefill_block  # CAOTE prefills block-wise (Sec. 4.1)
    assert not make_policy("caote:h2o", budget=64, prefill_block=False).prefill_block
    cache = SieveCache(2, meta_init=base.scorer.meta_init)
    cache.begin_step(torch.arange(5).expand(B, 5))
    for i in range(2):
        cache.update(torch.randn(B, H, 5, D), torch.randn(B, H, 5, D), i)
    probs = torch.rand(B, H, G, 2, cache.layers[0].capacity)
    base.observer()(cache.layers[0], 0, probs, None)
    wrapped.observer()(cache.layers[1], 1, probs, None)
    assert torch.equal(cache.layers[0].meta["acc"], cache.layers[1].meta["acc"])  # H2O's own update
    tova = make_policy("caote:tova", budget=64, heads="group", recent=4)
    assert tova.scorer.inner.heads == "group" and tova.recent == 4 and tova.scorer.query_window() == 1
    assert make_policy("fastcaote:snapkv", budget=96).recent == 64  # SnapKV's window is still protected


def test_wrapper_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown method wrapper 'coate'.*caote, fastcaote"):
        make_policy("coate:tova", budget=64)
    with pytest.raises(ValueError, match="unknown method 'tovaa'"):
        make_policy("caote:tovaa", budget=64)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['windw'\] for 'snapkv'"):
        make_policy("caote:snapkv", budget=64, windw=3)
    with pytest.raises(ValueError, match="caote needs a budgeted base; 'lagkv'"):
        make_policy("caote:lagkv")
    with pytest.raises(ValueError, match="needs a positive --budget"):
        make_policy("caote:tova")
    assert {"caote", "fastcaote"} <= set(WRAPPERS)
    rows = {r["name"]: r for r in describe_methods()}
    assert rows["caote:<base>"]["params"] == {"prefill_block": True} and "Eqs. 8, 20-21" in rows["caote:<base>"]["source"]


# ============================================================================ end to end (bundled model)


@pytest.fixture(scope="module")
def full_run(smollm):
    return generate(*smollm, [SHORT, LONG], None, GenerateConfig(max_new_tokens=16))


@pytest.mark.parametrize("method", ["caote:tova", "caote:h2o", "fastcaote:snapkv"])
def test_budget_at_least_length_reproduces_full(smollm, full_run, method):
    result = generate(*smollm, [SHORT, LONG], make_policy(method, budget=4096),
                      GenerateConfig(max_new_tokens=16, prefill_chunk=CAOTE_BLOCK))
    assert result.token_ids == full_run.token_ids
    assert all(s.compression_events == 0 for s in result.stats)



@pytest.mark.parametrize("method", ["ams:caote:tova", "ams:fastcaote:h2o"])
def test_caote_under_ams_scores_through_its_view_and_stays_within_budget_plus_interval(smollm, method):
    """AMS hands its base a per-head view of the layer: CAOTE then recomputes o itself instead of
    reading the attention pass's (whose shapes are the layer's)."""
    budget, interval = 48, 8
    result = generate(*smollm, [SHORT, LONG], make_policy(method, budget=budget, interval=interval),
                      GenerateConfig(max_new_tokens=40))
    assert all(s.compression_events > 0 for s in result.stats)
    kv_heads = smollm[0].config.num_key_value_heads  # token counts are per layer, summed over kv heads
    assert all(max(s.final_kv_tokens) <= kv_heads * (budget + interval) for s in result.stats)


def test_block_wise_prefill_and_decode_stay_within_budget(smollm, monkeypatch):
    budget, block = 24, 16
    policy = make_policy("caote:tova", budget=budget, heads="group")
    seen_in_prefill, original = [], gen_module.compress

    def checked(cache, pol, layer_budgets):
        before = max(layer.max_len for layer in cache.layers)
        did = original(cache, pol, layer_budgets)
        if did:  # (before, padding slots of a prefill chunk may still sit in front)
            for layer in cache.layers:
                assert (layer.lengths <= budget).all() and (layer.live().sum(-1) == layer.lengths).all()
            seen_in_prefill.append((int(cache.seen_tokens.max()), before))
        return did

    monkeypatch.setattr(gen_module, "compress", checked)
    result = generate(*smollm, [SHORT, LONG], policy, GenerateConfig(max_new_tokens=12, prefill_chunk=block))
    prompt = max(s.prompt_tokens for s in result.stats)
    in_prefill = [(n, before) for n, before in seen_in_prefill if n < prompt]
    assert len(in_prefill) >= 2  # evicted block by block while the prompt was read
    assert all(before <= budget + block for _, before in in_prefill)  # never more than one block over
    assert all(max(s.peak_kv_tokens) <= 3 * (budget + block) for s in result.stats)
    assert all(s.compression_events >= 10 for s in result.stats)


@dataclass
class _AttachCounting(TOVA):
    """TOVA plus an ``attach`` that logs its entry, exit and every callback call (test only, not registered)."""

    def __post_init__(self):
        super().__post_init__()
        self.log: list = []

    @contextlib.contextmanager
    def attach(self, model, tokenizer):
        self.log.append("enter")
        try:
            yield lambda token_ids, query_pos, rows: self.log.append(("tokens", token_ids.shape[0]))
        finally:
            self.log.append("exit")


@pytest.mark.parametrize("prefix", sorted(WRAPPERS))
def test_every_wrapper_forwards_attach_once_per_generate_call(smollm, prefix):
    """``generate`` enters ``policy.scorer.attach`` once per call; a wrapper must hand that to its base
    (SkipKV builds its sentence table there), including the per-forward callback the base yields."""
    base = _AttachCounting(heads="group")
    policy = make_policy(f"{prefix}:tova", budget=24, heads="group", recent=4, interval=2)
    policy = dataclasses.replace(policy, scorer=type(policy.scorer)(base))
    config = GenerateConfig(max_new_tokens=6, prefill_chunk=16)
    for call in (1, 2):
        generate(*smollm, [SHORT, LONG], policy, config)
        assert base.log.count("enter") == base.log.count("exit") == call
        assert base.log[0] == "enter" and base.log[-1] == "exit"
    forwards = [entry for entry in base.log if entry not in ("enter", "exit")]
    assert forwards and all(rows == 2 for _, rows in forwards)  # called before every forward, both rows


def test_caote_over_skipkv_sees_sentences(smollm, recwarn):
    """``caote:skipkv``: SkipKV's attach runs through the wrapper, so its sentence table fills and no
    "runs without its attach() hook" warning is raised when it scores."""
    policy = make_policy("caote:skipkv", budget=40, interval=4)
    result = generate(*smollm, [SHORT, LONG], policy, GenerateConfig(max_new_tokens=12, prefill_chunk=CAOTE_BLOCK))
    assert all(s.compression_events > 0 for s in result.stats)
    assert not [w for w in recwarn if "attach" in str(w.message)]
    table = policy.scorer.inner.sentences
    assert table is not None and table.rows is not None and int(table.open.max()) > 0
