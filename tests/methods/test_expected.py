"""Expected Attention: the score equals [24]'s closed form recomputed with explicit RoPE rotation
matrices, reduces to the true attention of a future query when the queries do not vary, and
takes the model's RoPE frequencies from ``attach``."""

from __future__ import annotations

import pytest
import torch

from kvsieve import GenerateConfig, generate
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.methods import make_policy
from kvsieve.methods.expected import ExpectedAttention, model_inv_freq, standard_inv_freq

B, H, G, D = 2, 2, 3, 8
SCALE = 0.3
THETA = 50.0  # small base: rotations differ a lot over a few positions


def rotation(p: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """[D, D] RoPE matrix at position p, pairs (i, i + D/2) rotated by p * inv_freq[i]."""
    half = inv_freq.numel()
    R = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    for i, w in enumerate(inv_freq.tolist()):
        c, s = torch.cos(torch.tensor(p * w)), torch.sin(torch.tensor(p * w))
        R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
    return R


def make_layer(seed, pre_queries=None, qpos=None, inv_freq=None):
    """14 cached tokens (row 1 has a dead slot), 6 recorded queries (row 1: one padding query)."""
    g = torch.Generator().manual_seed(seed)
    cache = SieveCache(1)
    pos = torch.tensor([list(range(14)), [DEAD_POS] + list(range(13))])
    cache.begin_step(pos)
    cache.update(torch.randn(B, H, 14, D, generator=g, dtype=torch.float64).float(),
                 torch.randn(B, H, 14, D, generator=g), 0)
    layer = cache.layers[0]
    qpos = qpos if qpos is not None else torch.tensor([[2, 9, 10, 11, 12, 13], [DEAD_POS, 8, 9, 10, 11, 12]])
    pre = pre_queries if pre_queries is not None else torch.randn(B, H * G, 6, D, generator=g) * 2
    post = pre.clone().double()
    if inv_freq is not None:
        for b in range(B):
            for j in range(6):
                p = int(qpos[b, j]) if qpos[b, j] != DEAD_POS else 0
                post[b, :, j] = post[b, :, j] @ rotation(p, inv_freq).T
    layer.recent_queries, layer.recent_query_pos, layer.scaling = post.float(), qpos, SCALE
    return layer, pre.double(), torch.tensor([14, 13])


def reference(layer, pre, seen, inv_freq, scorer):
    """[24] / kvpress from the definition, with explicit matrices, one (row, query head) at a time."""
    keys, values, pos = layer.keys.double(), layer.values.double(), layer.meta["pos"]
    out = torch.zeros(B, H, keys.shape[2], dtype=torch.float64)
    for b in range(B):
        use = [j for j in range(6) if layer.recent_query_pos[b, j] != DEAD_POS
               and layer.recent_query_pos[b, j] >= scorer.sinks]
        if inv_freq is None:
            Rbar = torch.eye(D, dtype=torch.float64)
            qs = layer.recent_queries.double()[b][:, use]
        else:
            Rbar = sum(rotation(int(seen[b]) + t, inv_freq) for t in range(scorer.n_future)) / scorer.n_future
            qs = pre[b][:, use]
        for h in range(H):
            scored = [i for i in range(keys.shape[2]) if pos[b, h, i] != DEAD_POS and pos[b, h, i] >= scorer.sinks]
            acc = torch.zeros(len(scored), dtype=torch.float64)
            for gq in range(G):
                q = qs[h * G + gq]  # [n, D]
                mu = q.mean(0)
                cov = (q - mu).T @ (q - mu) / q.shape[0]
                mu_bar, cov_bar = Rbar @ mu, Rbar @ cov @ Rbar.T
                k = keys[b, h, scored]
                logits = SCALE * k @ mu_bar + SCALE ** 2 / 2 * torch.einsum("id,de,ie->i", k, cov_bar, k)
                acc += logits.softmax(0) / G
            out[b, h, scored] = (acc + scorer.epsilon) * values[b, h, scored].norm(dim=-1)
    return out


def scored_slots(layer, sinks):
    pos = layer.meta["pos"]
    return (pos != DEAD_POS) & (pos >= sinks)


@pytest.mark.parametrize("seed", [0, 1])
def test_score_matches_the_closed_form_with_rope_averaged_over_future_positions(seed):
    scorer = ExpectedAttention(n_future=7, sinks=2, rope_theta=THETA)
    inv_freq = standard_inv_freq(D, THETA)
    layer, pre, seen = make_layer(seed, inv_freq=inv_freq)
    got = scorer.score(layer, seen)
    want = reference(layer, pre, seen, inv_freq, scorer)
    mask = scored_slots(layer, 2)
    torch.testing.assert_close(got[mask].double(), want[mask], rtol=2e-4, atol=1e-6)
    # sinks (positions 0, 1: row 0's first two slots) get the head's top score (kvpress)
    top = got.masked_fill(~mask, float("-inf")).amax(-1)  # [B, H]
    assert torch.equal(got[0, :, :2], top[0, :, None].expand(H, 2))


def test_constant_queries_and_one_future_position_give_the_true_future_attention():
    inv_freq = standard_inv_freq(D, THETA)
    q = torch.randn(1, H * G, 1, D).double()
    pre = q.expand(B, H * G, 6, D).clone()
    layer, _, seen = make_layer(3, pre_queries=pre.float(), inv_freq=inv_freq)
    scorer = ExpectedAttention(n_future=1, sinks=0, epsilon=0.0, use_vnorm=False, rope_theta=THETA)
    got = scorer.score(layer, seen)  # covariance 0: the expectation is the attention itself
    for b in range(B):
        future = q[0, :, 0] @ rotation(int(seen[b]), inv_freq).T  # the query at position seen[b]
        for h in range(H):
            live = layer.meta["pos"][b, h] != DEAD_POS
            attn = (SCALE * layer.keys.double()[b, h, live] @ future[h * G:(h + 1) * G].T).softmax(0).mean(1)
            torch.testing.assert_close(got[b, h, live].double(), attn, rtol=1e-4, atol=1e-7)


def test_without_frequencies_the_post_rope_window_statistics_are_used():
    scorer = ExpectedAttention(n_future=5, sinks=1)
    layer, pre, seen = make_layer(4)
    got = scorer.score(layer, seen)
    mask = scored_slots(layer, 1)
    want = reference(layer, pre, seen, None, scorer)
    torch.testing.assert_close(got[mask].double(), want[mask], rtol=2e-4, atol=1e-6)


def test_attach_reads_the_model_frequencies_and_forgets_them(smollm):
    model, tok = smollm
    scorer = make_policy("ams:expected", budget=64).scorer.inner
    assert scorer.frequencies(64) is None
    with scorer.attach(model, tok):
        torch.testing.assert_close(scorer.frequencies(64), standard_inv_freq(64, 100000.0))  # SmolLM2
        with pytest.raises(ValueError, match="partial rotary"):
            scorer.frequencies(128)
    assert scorer.frequencies(64) is None
    assert torch.equal(model_inv_freq(model), model.model.rotary_emb.inv_freq.double())


def test_attached_frequencies_give_the_same_scores_as_rope_theta():
    inv_freq = standard_inv_freq(D, THETA)
    layer, _, seen = make_layer(5, inv_freq=inv_freq)
    rotary = torch.nn.Module()
    rotary.register_buffer("inv_freq", inv_freq.float())
    scorer = ExpectedAttention(n_future=9)
    with scorer.attach(rotary, None):
        attached = scorer.score(layer, seen)
    torch.testing.assert_close(attached, ExpectedAttention(n_future=9, rope_theta=THETA).score(layer, seen))


def test_settings_defaults_and_errors():
    policy = make_policy("expected", budget=64)
    s = policy.scorer
    assert (s.epsilon, s.n_future, s.hs_buffer, s.sinks) == (1e-2, 512, 256, 4)
    assert (policy.sinks, policy.recent, policy.interval, policy.compress_prefill) == (4, 0, 32, False)  # 512 capped at B/2
    assert make_policy("expected", budget=2048).interval == 512  # AMS Table 15's I where the budget allows
    assert s.needs.query_window == 256
    assert make_policy("expected", budget=64, sinks=2).scorer.sinks == 2  # shared with the policy
    with pytest.raises(ValueError, match="rope_theta"):
        make_policy("expected", budget=64, rope_theta=0.5)
    with pytest.raises(ValueError, match="epsilon >= 0"):
        make_policy("expected", budget=64, epsilon=-1)


def test_expected_compresses_within_budget_end_to_end(smollm):
    model, tok = smollm
    policy = make_policy("expected", budget=24, interval=8)
    result = generate(model, tok, ["What is 7 times 8?"], policy, GenerateConfig(max_new_tokens=24, ignore_eos=True))
    stat = result.stats[0]
    heads = model.config.num_key_value_heads
    assert stat.compression_events >= 2 and max(stat.final_kv_tokens) <= heads * (24 + 8)
    assert max(stat.peak_kv_tokens) == heads * (stat.prompt_tokens + 8)  # decode-only: prompt, then + I


def test_angles_of_repeated_rows_are_computed_once_and_equal_each_rows_own():
    from kvsieve.methods.expected import per_distinct_row, rope_angles

    inv_freq = standard_inv_freq(D, THETA)
    positions = torch.tensor([[5, 6, 7], [9, 10, 11], [5, 6, 7], [5, 6, 7]])
    calls = []

    def angles(p):
        calls.append(p.shape[0])
        return rope_angles(p, inv_freq)

    cos, sin = per_distinct_row(positions, angles)
    assert calls == [2]  # two distinct rows
    for row in range(4):
        own_cos, own_sin = rope_angles(positions[row:row + 1], inv_freq)
        assert torch.equal(cos[row], own_cos[0]) and torch.equal(sin[row], own_sin[0])


def test_a_stack_scored_a_few_rows_at_a_time_gives_each_rows_own_scores():
    """A stack larger than ``CHUNK_BYTES`` is scored in chunks of rows; every row's scores are the
    ones it gets scored alone (padding, sinks-only windows and positions differ between rows)."""
    from types import SimpleNamespace

    from kvsieve.methods._common import CHUNK_BYTES

    g = torch.Generator().manual_seed(7)
    rows, kv_heads, group, window, dim, cap = 8, 3, 3, 256, 64, 40
    assert rows * kv_heads * group * window * dim * 4 > 2 * CHUNK_BYTES  # at least three chunks
    qpos = torch.arange(window).repeat(rows, 1) + torch.arange(rows)[:, None] * 37
    qpos[2, :100] = DEAD_POS  # padding
    qpos[5] = torch.where(torch.arange(window) < 3, torch.arange(window), torch.full((window,), DEAD_POS))  # sinks only
    pos = torch.arange(cap).repeat(rows, kv_heads, 1)
    pos[1, :, 7] = DEAD_POS
    layer = SimpleNamespace(recent_queries=torch.randn(rows, kv_heads * group, window, dim, generator=g),
                            recent_query_pos=qpos, keys=torch.randn(rows, kv_heads, cap, dim, generator=g),
                            values=torch.randn(rows, kv_heads, cap, dim, generator=g), meta={"pos": pos},
                            scaling=dim ** -0.5)
    seen = qpos.amax(dim=1) + 1
    scorer = ExpectedAttention(rope_theta=10000.0)
    stacked = scorer.score(layer, seen)
    for row in range(rows):
        alone = SimpleNamespace(recent_queries=layer.recent_queries[row:row + 1], recent_query_pos=qpos[row:row + 1],
                                keys=layer.keys[row:row + 1], values=layer.values[row:row + 1],
                                meta={"pos": pos[row:row + 1]}, scaling=layer.scaling)
        assert torch.equal(stacked[row], scorer.score(alone, seen[row:row + 1])[0]), row
