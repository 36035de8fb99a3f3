"""Tests for kvsieve.attention against a per-(row, kv head) reference written with plain loops.

The cache is ragged: GQA with 6 query heads on 2 kv heads, every (row, kv head) compacted to
a different live length, a left-padded row whose padding slots partly survive compaction
(dead slots inside the live range), and more dead slots past each head's length.  The
reference never looks at the cache layout: it keeps its own list of (position, key, value)
per (row, kv head) and attends with softmax(q k^T * scale) @ v over the live tokens whose
position is <= the query's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsieve.attention import StepState, attention_probs, sieve_attention, visible, window_attention
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.schedule import indices_from_mask

B, HQ, HKV, D = 2, 6, 2, 8
G = HQ // HKV
MODULE = SimpleNamespace(layer_idx=1)  # the layer under test is the cache's second layer


def build_ragged_cache(seed: int, query_window: int = 0):
    """A 2-layer SieveCache whose layer 1 is ragged; returns (cache, tokens, generator).

    tokens[b][h] is the reference list of (pos, key, value) in slot order (pos may be DEAD_POS).
    """
    g = torch.Generator().manual_seed(seed)
    cache = SieveCache(2, grow_chunk=4)
    layer = cache.layers[1]
    layer.query_window = query_window
    S = 9
    # row 1 is left padded by 3
    pos = torch.tensor([list(range(S)), [DEAD_POS] * 3 + list(range(S - 3))])
    k, v = torch.randn(B, HKV, S, D, generator=g), torch.randn(B, HKV, S, D, generator=g)
    cache.begin_step(pos)
    cache.update(k, v, 1)
    keep = torch.zeros(B, HKV, layer.capacity, dtype=torch.bool)
    kept = {  # per (row, kv head): slots kept; different lengths, padding slots 1 and 2 survive in row 1
        (0, 0): [0, 1, 2, 3, 4, 5, 6, 7, 8],
        (0, 1): [0, 3, 7, 8],
        (1, 0): [1, 3, 4, 6, 7],
        (1, 1): [2, 5, 8],
    }
    for (b, h), slots in kept.items():
        keep[b, h, slots] = True
    K = int(keep.sum(-1).max())
    kept_idx, lengths = indices_from_mask(keep, K)
    layer.compact(kept_idx, lengths, capacity=K + 1, max_len=K)
    tokens = [[[(int(pos[b, s]), k[b, h, s], v[b, h, s]) for s in kept[(b, h)]] for h in range(HKV)] for b in range(B)]
    seen = torch.tensor([S, S - 3])
    return cache, tokens, g, seen


def step(cache, tokens, g, qpos_rows, observer=None, scaling=None):
    """One attention call the way a decoder layer makes it: update, then sieve_attention."""
    T = len(qpos_rows[0])
    qpos = torch.tensor(qpos_rows)
    q = torch.randn(B, HQ, T, D, generator=g)
    k, v = torch.randn(B, HKV, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g)
    cache.begin_step(qpos)
    key, value = cache.update(k, v, MODULE.layer_idx)
    state = StepState(cache=cache, query_pos=qpos, observer=observer)
    out, weights = sieve_attention(MODULE, q, key, value, attention_mask=None, scaling=scaling, kvsieve=state)
    assert weights is None
    for b in range(B):
        for h in range(HKV):
            for t in range(T):
                tokens[b][h].append((qpos_rows[b][t], k[b, h, t], v[b, h, t]))
    return q, qpos, out


def reference(q, qpos, tokens, scaling):
    """[B, T, HQ, D] attention and per-query {position: prob} over live visible tokens, with loops."""
    T = q.shape[2]
    out = torch.full((B, T, HQ, D), float("nan"))
    probs = {}
    for b in range(B):
        for hq in range(HQ):
            h = hq // G
            for t in range(T):
                p = int(qpos[b, t])
                if p == DEAD_POS:
                    continue
                toks = [(tp, k, v) for tp, k, v in tokens[b][h] if tp != DEAD_POS and tp <= p]
                ks = torch.stack([k for _, k, _ in toks])
                vs = torch.stack([v for _, _, v in toks])
                w = torch.softmax((ks @ q[b, hq, t]) * scaling, dim=0)
                out[b, t, hq] = w @ vs
                probs[b, hq, t] = {tp: float(wi) for (tp, _, _), wi in zip(toks, w)}
    return out, probs


PREFILL = [[9, 10, 11], [DEAD_POS, 6, 7]]  # a causal T=3 chunk; row 1 starts with a padding query


def real(qpos):
    return qpos != DEAD_POS  # [B, T]


@pytest.mark.parametrize("seed", range(3))
def test_prefill_chunk_on_ragged_gqa_cache_matches_per_head_softmax_reference(seed):
    cache, tokens, g, _ = build_ragged_cache(seed)
    layer = cache.layers[1]
    assert layer.lengths.tolist() == [[9, 4], [5, 3]]
    q, qpos, out = step(cache, tokens, g, PREFILL, scaling=0.3)
    assert out.shape == (B, 3, HQ, D)
    assert layer.lengths.tolist() == [[12, 7], [8, 6]]
    ref, _ = reference(q, qpos, tokens, 0.3)
    mask = real(qpos)
    torch.testing.assert_close(out[mask], ref[mask], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()  # padding queries too
    assert layer.scaling == 0.3


def test_decode_step_matches_reference_and_uses_default_scale():
    cache, tokens, g, _ = build_ragged_cache(7)
    q, qpos, out = step(cache, tokens, g, PREFILL, scaling=None)
    ref, _ = reference(q, qpos, tokens, D**-0.5)
    torch.testing.assert_close(out[real(qpos)], ref[real(qpos)], rtol=1e-5, atol=1e-5)
    assert cache.layers[1].scaling == pytest.approx(D**-0.5)
    # Two single-token decode steps (the T == 1 SDPA path).
    for p in ([12, 8], [13, 9]):
        q, qpos, out = step(cache, tokens, g, [[p[0]], [p[1]]], scaling=None)
        ref, _ = reference(q, qpos, tokens, D**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_only_dead_slots_and_the_future_are_masked():
    # Changing what a dead slot or a future token holds does not change the output.
    cache, tokens, g, _ = build_ragged_cache(3)
    layer = cache.layers[1]
    qpos = torch.tensor([[9], [6]])
    cache.begin_step(qpos)
    key, value = cache.update(torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g), 1)
    q = torch.randn(B, HQ, 1, D, generator=g)
    state = StepState(cache=cache, query_pos=qpos)
    out, _ = sieve_attention(MODULE, q, key, value, scaling=0.5, kvsieve=state)
    invisible = ~visible(layer.meta["pos"], qpos)[:, :, 0]  # [B, H, cap]
    assert invisible.any() and (~invisible).any()
    key2 = torch.where(invisible[..., None], 1e3 * torch.randn(key.shape, generator=g), key)
    value2 = torch.where(invisible[..., None], 1e3 * torch.randn(value.shape, generator=g), value)
    out2, _ = sieve_attention(MODULE, q, key2, value2, scaling=0.5, kvsieve=state)
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)


def test_padding_queries_give_finite_outputs_even_on_an_all_dead_row():
    cache = SieveCache(2)
    g = torch.Generator().manual_seed(0)
    qpos = torch.tensor([[DEAD_POS, DEAD_POS], [0, 1]])  # row 0 is all padding
    cache.begin_step(qpos)
    key, value = cache.update(torch.randn(B, HKV, 2, D, generator=g), torch.randn(B, HKV, 2, D, generator=g), 1)
    q = torch.randn(B, HQ, 2, D, generator=g)
    for observer in (None, lambda layer, idx, probs, qpos: None):
        out, _ = sieve_attention(MODULE, q, key, value, kvsieve=StepState(cache, qpos, observer))
        assert torch.isfinite(out).all()


def test_missing_step_state_is_an_error_that_says_what_to_do():
    with pytest.raises(RuntimeError, match="kvsieve.generate"):
        sieve_attention(MODULE, torch.zeros(1, HQ, 1, D), torch.zeros(1, HKV, 1, D), torch.zeros(1, HKV, 1, D))


@pytest.mark.parametrize("chunk", [PREFILL, [[9], [6]]], ids=["prefill", "decode"])
def test_observer_path_matches_sdpa_path_and_sees_normalised_causal_probs(chunk):
    cache_a, tokens_a, g_a, _ = build_ragged_cache(11)
    cache_b, tokens_b, g_b, _ = build_ragged_cache(11)
    seen = []

    def observer(layer, layer_idx, probs, query_pos):
        seen.append((layer, layer_idx, probs.clone()))

    q, qpos, out_sdpa = step(cache_a, tokens_a, g_a, chunk, scaling=0.4)
    q_b, _, out_obs = step(cache_b, tokens_b, g_b, chunk, observer=observer, scaling=0.4)
    assert torch.equal(q, q_b)
    torch.testing.assert_close(out_obs, out_sdpa, rtol=1e-5, atol=1e-5)

    assert len(seen) == 1
    layer, layer_idx, probs = seen[0]
    assert layer is cache_b.layers[1] and layer_idx == 1
    T = len(chunk[0])
    assert probs.shape == (B, HKV, G, T, layer.capacity)
    allowed = visible(layer.meta["pos"], qpos)  # [B, H, T, cap]
    _, ref_probs = reference(q, qpos, tokens_b, 0.4)
    for b in range(B):
        for hq in range(HQ):
            h, gi = divmod(hq, G)
            for t in range(T):
                row = probs[b, h, gi, t]
                if qpos[b, t] == DEAD_POS:
                    assert torch.isfinite(row).all()
                    continue
                assert float(row[allowed[b, h, t]].sum()) == pytest.approx(1.0, abs=1e-5)
                assert (row[~allowed[b, h, t]] == 0).all()
                # and each visible slot holds the reference probability of the token there
                for s in torch.nonzero(allowed[b, h, t]).flatten().tolist():
                    p = int(layer.meta["pos"][b, h, s])
                    assert float(row[s]) == pytest.approx(ref_probs[b, hq, t][p], abs=1e-6)


def test_attention_probs_groups_query_heads_onto_their_kv_head():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, 2, D, generator=g)
    k = torch.randn(1, HKV, 5, D, generator=g)
    allowed = torch.ones(1, HKV, 2, 5, dtype=torch.bool)
    allowed[0, 1, :, 3:] = False
    probs = attention_probs(q, k, allowed, 0.7)
    for hq in range(HQ):
        h, gi = divmod(hq, G)
        n = 5 if h == 0 else 3
        expected = torch.softmax(q[0, hq] @ k[0, h, :n].T * 0.7, dim=-1)
        torch.testing.assert_close(probs[0, h, gi, :, :n], expected, rtol=1e-5, atol=1e-6)
        assert (probs[0, h, gi, :, n:] == 0).all()


def test_attention_probs_masks_bit_for_bit_as_masked_fill():
    """The additive 0/-inf bias gives exactly the rows of filling masked logits with -inf, including
    rows with nothing visible (all NaN, as softmax of -inf everywhere) and -0.0 logits."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, HQ, 4, D, generator=g)
    k = torch.randn(3, HKV, 7, D, generator=g)
    k[0, 0, 2] = 0.0  # a zero key: its logits are signed zeros
    allowed = torch.rand(3, HKV, 4, 7, generator=g) > 0.4
    allowed[1, 1, 2] = False  # a query that sees nothing
    B3, H, T, S = allowed.shape
    logits = (q.reshape(B3, H, G * T, D) * 0.3) @ k.transpose(-1, -2)
    expected = logits.view(B3, H, G, T, S).masked_fill(~allowed[:, :, None], float("-inf")).softmax(dim=-1)
    probs = attention_probs(q, k, allowed, 0.3)
    assert probs[1, 1, :, 2].isnan().all()
    assert torch.equal(probs.isnan(), expected.isnan())
    assert torch.equal(probs.nan_to_num(-1.0), expected.nan_to_num(-1.0))


def test_window_attention_zeroes_padding_query_rows_and_matches_reference_for_real_ones():
    cache, tokens, g, _ = build_ragged_cache(5, query_window=4)
    layer = cache.layers[1]
    q1, qpos1, _ = step(cache, tokens, g, PREFILL, scaling=0.25)
    q2, qpos2, _ = step(cache, tokens, g, [[12], [8]], scaling=0.25)
    # window of 4: the whole chunk plus the decode query
    assert layer.recent_query_pos.tolist() == [[9, 10, 11, 12], [DEAD_POS, 6, 7, 8]]
    q = torch.cat([q1, q2], dim=2)
    qpos = torch.cat([qpos1, qpos2], dim=1)
    probs = window_attention(layer)
    assert probs.shape == (B, HKV, G, 4, layer.capacity)
    assert (probs[1, :, :, 0] == 0).all()  # the padding query's rows
    _, ref = reference(q, qpos, tokens, 0.25)  # reference over the *current* cache
    for b in range(B):
        for hq in range(HQ):
            h, gi = divmod(hq, G)
            for t in range(4):
                if qpos[b, t] == DEAD_POS:
                    continue
                row = probs[b, h, gi, t]
                assert float(row.sum()) == pytest.approx(1.0, abs=1e-5)
                for s in range(layer.capacity):
                    p = int(layer.meta["pos"][b, h, s])
                    assert float(row[s]) == pytest.approx(ref[b, hq, t].get(p, 0.0), abs=1e-6)


def test_window_attention_without_recorded_queries_says_the_scorer_needs_a_window():
    cache, _, _, _ = build_ragged_cache(0, query_window=0)
    with pytest.raises(RuntimeError, match="query_window"):
        window_attention(cache.layers[1])
