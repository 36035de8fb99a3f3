"""CAOTE and FastCAOTE against references written here from the paper, never from the code under
test: the score of every token is the true change of the attention output when that token is
evicted and the rest renormalised, found by brute force (Thm. 3.2 for the attention itself; Eqs.
20-21 on a base's normalised scores; GQA heads concatenated, App. B.2); the base's per-query-head
scores are recomputed in plain torch (TOVA's attention rows, SnapKV's pooled window votes); the
``<prefix>:<base>`` wrapper keeps the base's behaviour otherwise, reports the base's settings and
evicts one token per generated token (Sec. 2, m = 1); end to end on the bundled SmolLM2."""

from __future__ import annotations

import contextlib
import dataclasses
import json
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
from kvsieve.schedule import indices_from_mask, observer

B, H, G, D = 2, 2, 3, 8
HQ = H * G
SCALE = 0.4
CAOTE_BLOCK = WRAPPERS["caote"].schedule["prefill_block"]  # 128, Sec. 4.1
SHORT = "What is 7 times 8?"
LONG = ("Here is a short story. A fox lived near a river and every morning it walked to the water "
        "to drink. One day it met a heron standing on one leg. Tell me, in two sentences, what the fox said.")


def attend(cache, g, qpos_rows, observer=None):
    qpos = torch.tensor(qpos_rows)
    T = qpos.shape[1]
    q = torch.randn(B, HQ, T, D, generator=g) * 2
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    cache.begin_step(qpos)
    key, value = cache.layers[0].update(k, v, qpos)  # room, append and count, as the engine's step does
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


# ---------------------------------------------------------------------------- brute-force references


def live_slots(layer, b, h) -> list[int]:
    return [s for s in range(layer.capacity) if layer.meta["pos"][b, h, s] != DEAD_POS]


def logits_of(layer, b, hq, slots, query=-1):
    """One query head's attention logits over the given slots of its kv head (plain torch)."""
    return layer.keys[b, hq // G, slots] @ layer.recent_queries[b, hq, query] * SCALE


def attention_change(layer, b, hq, slots, j) -> float:
    """Squared change of query head hq's output (newest query) when slot ``slots[j]`` is dropped
    and the softmax is recomputed over the others (Eqs. 9-11, Thm. 3.2)."""
    logits, values = logits_of(layer, b, hq, slots), layer.values[b, hq // G, slots]
    rest = [i for i in range(len(slots)) if i != j]
    before = logits.softmax(0) @ values
    after = logits[rest].softmax(0) @ values[rest]
    return float((before - after).square().sum())


def renormalised_change(weights, values, j) -> float:
    """Squared change of o = sum_i w_i v_i (weights summing to 1) when token j is dropped and
    the others are renormalised to sum to 1 (Thm. 3.1 applied to a base's scores, Eq. 20)."""
    rest = [i for i in range(len(weights)) if i != j]
    before = weights @ values
    after = (weights[rest] / weights[rest].sum()) @ values[rest]
    return float((before - after).square().sum())


def snapkv_votes(layer, b, hq, window, kernel) -> torch.Tensor:
    """SnapKV's score of every live slot of hq's kv head for query head hq alone, in slot order:
    the softmax attention of each of the last ``window`` real queries (each sees the keys at or
    before its position), summed over the window, then averaged over each token's neighbours
    within kernel // 2 along the sequence (SnapKV Sec. 4.2; at the ends over the neighbours
    there are, as kvsieve's ``pool_along_sequence`` does)."""
    h = hq // G
    slots = live_slots(layer, b, h)
    pos = layer.meta["pos"][b, h, slots]
    assert pos.tolist() == sorted(pos.tolist())  # slot order is sequence order here
    votes = torch.zeros(len(slots))
    for t in range(-window, 0):
        qpos = int(layer.recent_query_pos[b, t])
        if qpos == DEAD_POS:
            continue
        seen = pos <= qpos
        votes[seen] += logits_of(layer, b, hq, slots, query=t)[seen].softmax(0)
    r = kernel // 2
    return torch.stack([votes[max(0, i - r): i + r + 1].mean() for i in range(len(slots))])


# ---------------------------------------------------------------------------- scores (Eq. 8, 20-22)


def test_score_equals_the_true_output_change_of_evicting_one_token():
    """Thm. 3.2 per query head, App. B.2 over a GQA group: exact for TOVA's per-head scores."""
    layer, seen = decode_cache(0)
    scores = make_policy("caote:tova", budget=4, heads="group").scorer.score(layer, seen)
    assert scores.shape == (B, H, layer.capacity)
    for b in range(B):
        for h in range(H):
            slots = live_slots(layer, b, h)
            assert len(slots) == int(layer.lengths[b, h]) >= 5
            change = {slot: sum(attention_change(layer, b, hq, slots, j) for hq in range(h * G, (h + 1) * G)) ** 0.5
                      for j, slot in enumerate(slots)}
            for slot, expected in change.items():
                assert float(scores[b, h, slot]) == pytest.approx(expected, rel=1e-4, abs=1e-6)
            least = min(change, key=change.get)
            assert least == min(change, key=lambda s: float(scores[b, h, s]))  # evicted first


def test_snapkv_per_query_head_scores_are_plain_snapkv_votes():
    """The base scores CAOTE asks SnapKV for, one row per query head, equal SnapKV's pooled
    window votes computed here for that head alone."""
    policy = make_policy("caote:snapkv", budget=8, window=4, kernel=5)
    layer, seen = decode_cache(5, ragged=False)  # no dead slot between live ones (only row 1's padding, first)
    per_head = policy.scorer.base_scores(layer, seen)  # [B, H, G, cap]
    assert per_head.shape == (B, H, G, layer.capacity)
    for b in range(B):
        for hq in range(HQ):
            h, g = divmod(hq, G)
            want = snapkv_votes(layer, b, hq, window=4, kernel=5)
            torch.testing.assert_close(per_head[b, h, g, live_slots(layer, b, h)], want, rtol=1e-5, atol=1e-6)


def test_snapkv_score_is_the_renormalised_output_change_per_query_head_eq_20_21():
    """caote:snapkv: per query head, h = SnapKV's votes / their sum (Eq. 21), o = h V (Eq. 20);
    the score is the change of o when a token is dropped and h renormalised, root-sum-square
    over the group's query heads (App. B.2), all recomputed here by brute force."""
    policy = make_policy("caote:snapkv", budget=8, window=4, kernel=5)
    layer, seen = decode_cache(8, ragged=False)
    scores = policy.scorer.score(layer, seen)
    for b in range(B):
        for h in range(H):
            slots = live_slots(layer, b, h)
            values = layer.values[b, h, slots]
            weights = [(v := snapkv_votes(layer, b, hq, 4, 5)) / v.sum() for hq in range(h * G, (h + 1) * G)]
            for j, slot in enumerate(slots):
                expected = sum(renormalised_change(w, values, j) for w in weights) ** 0.5
                assert float(scores[b, h, slot]) == pytest.approx(expected, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("heads", ["layer", "group"])
def test_tova_per_query_head_scores_are_each_heads_attention_row_or_their_layer_mean(heads):
    """Group mode: each query head's own row ([B, H, G, cap], recomputed from the last query).
    Layer mode: the layer mean, read from the state observed in the forward pass ([B, H, 1, cap])."""
    policy = make_policy("tova", budget=8, heads=heads)
    layer, seen = decode_cache(6, ragged=heads == "group", meta_init=policy.scorer.needs.meta,
                               observer=observer(policy))  # layer mode: every head holds the same tokens
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
            slots = live_slots(layer, b, h)
            values = layer.values[b, h, slots]
            mean = values.mean(0)
            weights = [logits_of(layer, b, hq, slots).softmax(0) for hq in range(h * G, (h + 1) * G)]
            for j, slot in enumerate(slots):
                per_head = [float(a[j] / (1 - a[j]) * (mean - values[j]).norm()) for a in weights]
                assert float(scores[b, h, slot]) == pytest.approx(sum(e * e for e in per_head) ** 0.5, rel=1e-4)


def test_h2o_score_is_the_output_change_with_its_sums_normalised_eq_21():
    """H2O's accumulated attention per kv head (one row, G' = 1) divided by its sum (Eq. 21,
    sum h > 1 by Thm. B.1): the score is the brute-force change of o = h V."""
    policy = make_policy("caote:h2o", budget=4)
    layer, seen = decode_cache(2, meta_init=policy.scorer.needs.meta)
    layer.meta["acc"] = torch.rand(layer.meta["acc"].shape, generator=torch.Generator().manual_seed(3)) * 5
    scores = policy.scorer.score(layer, seen)
    for b in range(B):
        for h in range(H):
            slots = live_slots(layer, b, h)
            acc, values = layer.meta["acc"][b, h, slots], layer.values[b, h, slots]
            for j, slot in enumerate(slots):
                expected = renormalised_change(acc / acc.sum(), values, j) ** 0.5
                assert float(scores[b, h, slot]) == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_layer_averaged_tova_gives_one_score_per_layer_from_every_heads_change():
    """TOVA's default keeps one token set per layer (the mean attention of all its query heads),
    so evicting a token changes every query head's output: the score is the norm of all those
    changes together (App. B.2 Case 2 over the layer), the same for every kv head."""
    policy = make_policy("caote:tova", budget=4)
    layer, seen = decode_cache(4, ragged=False, meta_init=policy.scorer.needs.meta,
                               observer=observer(policy))  # TOVA's layer average needs aligned heads
    assert policy.scorer.needs.aligned_heads
    scores = policy.scorer.score(layer, seen)
    for b in range(B):
        slots = live_slots(layer, b, 0)
        assert all(live_slots(layer, b, h) == slots for h in range(H))
        a = torch.stack([logits_of(layer, b, hq, slots).softmax(0) for hq in range(HQ)]).mean(0)  # TOVA's score
        for j, slot in enumerate(slots):
            expected = sum(renormalised_change(a, layer.values[b, hq // G, slots], j) for hq in range(HQ)) ** 0.5
            for h in range(H):
                assert float(scores[b, h, slot]) == pytest.approx(expected, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("method,settings", [("caote:h2o", {}), ("caote:tova", {"heads": "group"}), ("fastcaote:h2o", {})])
def test_output_from_the_attention_pass_gives_the_same_scores(method, settings):
    """CAOTE's observe hands h (Eq. 21; FastCAOTE: uniform weights, Eq. 22) to the decode step's
    attention pass, which returns o = h V (Eq. 20) and o.v_j with its own output; scores from
    them equal scores recomputed at compression, and any change to the store drops them."""
    policy = make_policy(method, budget=4, **settings)
    layer, seen = decode_cache(7, meta_init=policy.scorer.needs.meta, observer=observer(policy))
    h, out, dots = layer.step_results["value_mix"]
    assert h.shape[:2] == (B, H) and h.shape[-1] == layer.capacity
    if method.startswith("fast"):  # uniform weights: the mean of the live values (Eq. 22)
        live = layer.live()
        mean = (layer.values * live[..., None]).sum(dim=2) / live.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(out[:, :, 0], mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, h @ layer.values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dots, out @ layer.values.transpose(-1, -2), rtol=1e-5, atol=1e-6)
    fused = policy.scorer.score(layer, seen)
    if method == "caote:tova":  # the fused path is exact too (Thm. 3.2, brute force)
        for b in range(B):
            for hk in range(H):
                slots = live_slots(layer, b, hk)
                for j, slot in enumerate(slots):
                    change = sum(attention_change(layer, b, hq, slots, j) for hq in range(hk * G, (hk + 1) * G))
                    assert float(fused[b, hk, slot]) == pytest.approx(change ** 0.5, rel=1e-4, abs=1e-6)
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
    expected = [renormalised_change(hn, values[0, 0, :3], j) ** 0.5 for j in range(3)]
    assert errors[:3].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert errors[0] == 0  # the base's lowest keeps zero weight


# ---------------------------------------------------------------------------- the wrapper


def test_wrapper_keeps_the_base_schedule_state_and_settings():
    base, wrapped = make_policy("h2o", budget=64), make_policy("caote:h2o", budget=64)
    assert wrapped.name == wrapped.settings()["method"] == "caote:h2o"
    assert (wrapped.sinks, wrapped.recent, wrapped.interval) == (base.sinks, base.recent, base.interval) == (0, 32, 1)
    assert wrapped.scorer.needs.meta == base.scorer.needs.meta and wrapped.scorer.needs.observes
    assert wrapped.prefill_block and not base.prefill_block  # CAOTE prefills block-wise (Sec. 4.1)
    assert not make_policy("caote:h2o", budget=64, prefill_block=False).prefill_block
    cache = SieveCache(2, meta_init=base.scorer.needs.meta)
    cache.begin_step(torch.arange(5).expand(B, 5))
    for i in range(2):
        cache.update(torch.randn(B, H, 5, D), torch.randn(B, H, 5, D), i)
    probs = torch.rand(B, H, G, 2, cache.layers[0].capacity)
    observer(base)(cache.layers[0], 0, probs, None)
    observer(wrapped)(cache.layers[1], 1, probs, None)
    assert torch.equal(cache.layers[0].meta["acc"], cache.layers[1].meta["acc"])  # H2O's own update
    tova = make_policy("caote:tova", budget=64, heads="group", recent=4)
    assert tova.scorer.inner.heads == "group" and tova.recent == 4 and tova.scorer.needs.query_window == 1
    assert make_policy("fastcaote:snapkv", budget=96).recent == 64  # SnapKV's window is still protected


@pytest.mark.parametrize("prefix", ["caote", "fastcaote"])
def test_decode_evicts_one_token_per_generated_token_whatever_the_base(prefix):
    """Sec. 2 ("During generation, the flow remains same with m=1") and Thm. 3.2: Eq. (8) is the
    error of one eviction after one new token, so the wrapper compresses every decode step even
    over bases that compress every 64 (SnapKV) or 128 (R-KV, SkipKV) steps on their own."""
    own = {"snapkv": 64, "rkv": 128, "skipkv": 128, "h2o": 1, "tova": 1, "keydiff": 1}
    for base, interval in own.items():
        assert make_policy(base, budget=256).interval == interval  # the base alone keeps its schedule
        policy = make_policy(f"{prefix}:{base}", budget=256)
        assert (policy.interval, policy.prefill_block) == (1, True)
        assert policy.settings()["interval"] == 1
    assert make_policy(f"{prefix}:snapkv", budget=256, interval=8).interval == 8  # an explicit setting wins
    row = {r["name"]: r for r in describe_methods()}[f"{prefix}:<base>"]
    assert row["params"] == {"interval": 1, "prefill_block": 128, "protect_prompt": False}  # Sec. 4.1: the prompt is evicted too


def test_settings_report_the_base_methods_settings():
    """Policy.settings() records the base scorer's hyperparameters under "base", so two runs of
    one wrapper over differently set bases never share a settings record (JSON-safe, nested for
    a wrapped wrapper)."""
    default = make_policy("caote:snapkv", budget=64).settings()
    assert default["base"] == {"window": 64, "kernel": 5, "pooling": "avg", "head_reduction": "mean"}
    narrow = make_policy("caote:snapkv", budget=64, window=16, kernel=3).settings()
    assert narrow["base"] == {"window": 16, "kernel": 3, "pooling": "avg", "head_reduction": "mean"}
    assert narrow != default and json.loads(json.dumps(narrow)) == narrow
    assert make_policy("fastcaote:tova", budget=64, heads="group").settings()["base"] == {"heads": "group"}
    assert make_policy("ams:fastcaote:h2o", budget=64).settings()["base"] == {"base": {"head_reduction": "sum", "recent_rule": "half"}}
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['base'\] for 'tova'"):
        make_policy("caote:tova", budget=64, base={"heads": "group"})  # a report, not a setting
    with pytest.raises(ValueError, match="cannot be set"):
        WRAPPERS["caote"](TOVA(), base={"heads": "group"})


def test_wrapper_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown method wrapper 'coate'.*caote, fastcaote"):
        make_policy("coate:tova", budget=64)
    with pytest.raises(ValueError, match="unknown method 'tovaa'"):
        make_policy("caote:tovaa", budget=64)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['windw'\] for 'snapkv'"):
        make_policy("caote:snapkv", budget=64, windw=3)
    with pytest.raises(ValueError, match="caote needs a budgeted base; 'lagkv'"):
        make_policy("caote:lagkv")
    with pytest.raises(ValueError, match="needs a positive budget="):
        make_policy("caote:tova")
    assert {"caote", "fastcaote"} <= set(WRAPPERS)
    rows = {r["name"]: r for r in describe_methods()}
    assert "Eqs. 8, 20-21" in rows["caote:<base>"]["source"]


# ============================================================================ end to end (bundled model)


@pytest.fixture(scope="module")
def full_run(full_greedy):
    return full_greedy([SHORT, LONG], 16)


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


@pytest.mark.parametrize("method,settings", [("caote:tova", {"heads": "group"}), ("caote:snapkv", {"window": 4}),
                                             ("fastcaote:rkv", {"window": 4})])
def test_block_wise_prefill_then_one_eviction_per_generated_token(smollm, monkeypatch, method, settings):
    """Sec. 2 / 4.1: the prompt is read block by block, evicting after each block (never more than
    one block over budget); then every generated token is followed by one eviction (m = 1), also
    over SnapKV (own interval 64) and R-KV (128).  Compressions are seen through the scorer's
    ``score``, which the engine calls once per layer it compresses."""
    budget, block, new = 24, 16, 12
    policy = make_policy(method, budget=budget, prefill_block=block, **settings)
    calls, score = [], policy.scorer.score

    def recording(layer, seen_tokens):  # live tokens per head before the eviction (a device read)
        calls.append((seen_tokens.tolist(), int(layer.lengths.max())))
        return score(layer, seen_tokens)

    monkeypatch.setattr(policy.scorer, "score", recording)
    result = generate(*smollm, [SHORT, LONG], policy,
                      GenerateConfig(max_new_tokens=new, ignore_eos=True))
    prompts = [s.prompt_tokens for s in result.stats]
    assert all(s.generated_tokens == new for s in result.stats)
    in_prefill = [before for seen, before in calls if all(n <= p for n, p in zip(seen, prompts))]
    in_decode = [(seen, before) for seen, before in calls if all(n > p for n, p in zip(seen, prompts))]
    assert len(in_prefill) + len(in_decode) == len(calls)
    layers, kv_heads = smollm[0].config.num_hidden_layers, smollm[0].config.num_key_value_heads
    assert len(in_prefill) >= 2 * layers  # evicted block by block while the prompt was read
    assert all(before <= budget + block for before in in_prefill)  # never more than one block over
    assert all(before == budget + 1 for _, before in in_decode)  # one new token, one eviction
    fed = range(1, new)  # every generated token but the last is fed back
    assert sorted({tuple(seen) for seen, _ in in_decode}) == [tuple(p + k for p in prompts) for k in fed]
    assert all(s.final_kv_tokens == [kv_heads * budget] * layers for s in result.stats)


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
