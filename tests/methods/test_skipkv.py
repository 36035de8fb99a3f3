"""SkipKV (arXiv:2512.07993) Sec. 4.1: sentence table, Eq. 3 marking, Eq. 6 score, eviction order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvsieve import GenerateConfig, generate
from kvsieve import schedule as schedule_module
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.generate import encode_prompts
from kvsieve.methods import make_policy
from kvsieve.methods._sentences import DELIMITERS, vocab_ids
from kvsieve.methods.skipkv import SentenceTable, SkipKV
from kvsieve.schedule import compress_layer

END = 0  # the delimiter token id in the hand-made tests
SHORT = "What is 7 times 8?"  # 38 tokens with SmolLM2's chat template
MEDIUM = "Tell me a story about a fox and a heron."  # 42 tokens


def one_layer(scorer, pos, G=2, D=8, window=4, seed=0):
    """A 1-layer cache holding tokens at ``pos`` [B, T] (one kv head, G query heads) and the
    last ``window`` positions as recorded queries."""
    g = torch.Generator().manual_seed(seed)
    B, T = pos.shape
    cache = SieveCache(1, meta_init=scorer.needs.meta, grow_chunk=8)
    cache.begin_step(pos)
    layer = cache.layers[0]
    layer.update(torch.randn(B, 1, T, D, generator=g), torch.randn(B, 1, T, D, generator=g), pos)
    layer.query_window, layer.scaling = window, D ** -0.5
    layer.remember_queries(torch.randn(B, G, T, D, generator=g), pos)
    return layer


def test_sentence_ids_follow_tokens_across_steps_and_compaction():
    table = SentenceTable(torch.tensor([END]), capacity=4)  # small: forces growth
    scorer = SkipKV()
    scorer.sentences = table
    # prefill: row 1 is left-padded; then three single-token decode steps
    ids = torch.tensor([[5, END, 6, 7, END, 8], [9, 9, 5, END, 6, END]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [DEAD_POS, DEAD_POS, 0, 1, 2, 3]])
    steps = [([9, 4], [6, 4]), ([END, 4], [7, 5]), ([3, END], [8, 6])]
    table.feed(ids, pos, torch.arange(2), torch.ones(2, 6, 3))
    for tok, p in steps:
        table.feed(torch.tensor(tok)[:, None], torch.tensor(p)[:, None], torch.arange(2), torch.ones(2, 1, 3))
    # row 0: [0-1] [2-4] [5-7] open 8..   row 1: [0-1] [2-3] [4-6] open
    assert table.open.tolist() == [3, 3]
    assert table.start[:, :4].tolist() == [[0, 2, 5, 8], [0, 2, 4, DEAD_POS]]
    assert table.count[:, :4].tolist() == [[2, 3, 3, 1], [2, 2, 3, 0]]  # padding counts nothing
    assert table.capacity >= 8

    all_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [DEAD_POS, DEAD_POS, 0, 1, 2, 3, 4, 5, 6]])
    layer = one_layer(scorer, all_pos)
    expected = {0: [0, 0, 1, 1, 1, 2, 2, 2, 3], 1: [0, 0, 1, 1, 2, 2, 2]}
    sent = scorer.label(layer)
    live = layer.live()
    for b in range(2):
        got = dict(zip(layer.meta["pos"][b, 0][live[b, 0]].tolist(), sent[b, 0][live[b, 0]].long().tolist()))
        assert got == dict(enumerate(expected[b]))
    # evict sentence 1 of row 0 (positions 2-4): ids move with their tokens, sentence 1 is gone
    kept = torch.tensor([[[0, 1, 5, 6, 7, 8]], [[2, 3, 4, 5, 6, 7]]])
    layer.compact(kept, torch.tensor([[6], [6]]), capacity=8, max_len=6)
    assert layer.meta["pos"][0, 0, :6].tolist() == [0, 1, 5, 6, 7, 8]
    assert layer.meta["sent"][0, 0, :6].tolist() == [0, 0, 2, 2, 2, 3]
    assert layer.meta["sent"][1, 0, :6].tolist() == [0, 0, 1, 1, 2, 2]
    assert (layer.meta["sent"][:, :, 6:] == -1).all()  # dead slots


def table_with(sentence_vectors, lengths, open_tail=1, d=4):
    """One row whose closed sentences have the given hidden directions and token counts, plus an
    open tail sentence with the direction of the first one."""
    hidden, ids = [], []
    for vec, n in zip(sentence_vectors, lengths):
        hidden += [vec] * n
        ids += [7] * (n - 1) + [END]
    hidden += [sentence_vectors[0]] * open_tail
    ids += [7] * open_tail
    table = SentenceTable(torch.tensor([END]))
    T = len(ids)
    table.feed(torch.tensor([ids]), torch.arange(T)[None], torch.tensor([0]), torch.stack(hidden)[None])
    return table


def test_pss_marks_the_earlier_sentence_of_each_similar_pair():
    e = torch.eye(4)
    near = F.normalize(e[0] + 0.1 * e[1], dim=0)  # cos(e0, near) = 0.995
    # s0 ~ s2 ~ s3 (s3 is near), s1 different, s4 is a one-token copy of s0
    table = table_with([e[0], e[1], e[0], near, e[0]], [3, 3, 2, 4, 1])
    lam = table.penalty(tau=0.95, min_tokens=2)[0, :6]
    cos_near = float(near @ e[0])
    assert lam[0].item() == pytest.approx(1.0)  # max over later partners (s2: 1.0, s3: 0.995)
    assert lam[1].item() == 0  # no similar later sentence
    assert lam[2].item() == pytest.approx(cos_near)  # earlier of (s2, s3)
    assert lam[3].item() == 0 and lam[4].item() == 0  # the latest is kept; one-token s4 ignored
    assert lam[5].item() == 0  # the open sentence (same direction as s0) takes no part
    assert table.penalty(tau=0.999, min_tokens=2)[0, 2].item() == 0  # 0.995 is not above tau


def manual_eq6(layer, lam_of_token, sigma, group_pool, redundancy, threshold):
    """Eq. 6 computed slot by slot with loops, for one row and one kv head."""
    keys, q, qpos = layer.keys[0, 0], layer.recent_queries[0], layer.recent_query_pos[0]
    pos, C = layer.meta["pos"][0, 0], layer.keys.shape[2]
    live = [j for j in range(C) if pos[j] != DEAD_POS]
    imp = torch.zeros(C)
    for t in range(q.shape[1]):
        seen = [j for j in live if pos[j] <= qpos[t]]
        per_head = torch.stack([q[g, t] @ keys.T * layer.scaling for g in range(q.shape[0])])  # [G, C]
        if group_pool == "logits":
            pooled = per_head.max(0).values[seen]
        else:
            pooled = torch.stack([per_head[g][seen].softmax(0) for g in range(q.shape[0])]).max(0).values
        imp[seen] += pooled.softmax(0) / q.shape[1]
    cos = F.normalize(keys, dim=-1) @ F.normalize(keys, dim=-1).T
    if threshold is not None:  # official cal_similarity_multi_batch: each row's latest partner above it -> 0
        for i in live:
            partners = [j for j in live if j != i and cos[i, j] > threshold]
            if partners:
                cos[i, max(partners)] = 0.0
    red = torch.zeros(C)
    if redundancy == "eq5":
        for i in live:
            others = [j for j in live if j != i]
            red[others] += cos[i, others].softmax(0) / len(live)
    else:
        mean = torch.tensor([cos[[i for i in live if i != j], j].mean() for j in live])  # column j: S_ij over rows i
        red[live] = mean.softmax(0)
    return sigma * imp - (1 - sigma) * red - lam_of_token


@pytest.mark.parametrize("group_pool,redundancy,threshold",
                         [("logits", "eq5", 0.5), ("probs", "rkv", 0.5), ("logits", "eq5", 0.1), ("logits", "eq5", None)])
def test_score_is_eq6(group_pool, redundancy, threshold):
    e = torch.eye(4)
    table = table_with([e[0], e[1], e[0]], [2, 3, 2])  # s0 ~ s2: s0 penalised by 1.0
    scorer = SkipKV(kernel=1, window=3, group_pool=group_pool, redundancy=redundancy, sigma=0.3,
                    partner_threshold=threshold)
    scorer.sentences = table
    layer = one_layer(scorer, torch.arange(8)[None], window=3)
    lam_of_token = torch.tensor([1.0, 1.0, 0, 0, 0, 0, 0, 0])
    got = scorer.score(layer, torch.tensor([8]))[0, 0, :8]
    want = manual_eq6(layer, lam_of_token, 0.3, group_pool, redundancy, threshold)
    torch.testing.assert_close(got, want[:8], rtol=1e-5, atol=1e-6)


def eviction_scene(budget):
    """16 tokens: s0 [0-3], s1 [4-7] repeated by s2 [8-11], open s3 [12-15]; recent window 8."""
    e = torch.eye(4)
    table = table_with([e[0], e[1], e[1]], [4, 4, 4], open_tail=4)
    policy = make_policy("skipkv", budget=budget)
    policy.scorer.sentences = table
    layer = one_layer(policy.scorer, torch.arange(16)[None], window=8, seed=3)
    compress_layer(layer, policy, budget, torch.tensor([16]))
    return layer


def test_redundant_sentence_goes_first_whole_then_partially():
    layer = eviction_scene(12)  # evict 4 = exactly the redundant sentence s1
    assert layer.meta["pos"][0, 0, :12].tolist() == [0, 1, 2, 3, *range(8, 16)]
    assert sorted(set(layer.meta["sent"][0, 0, :12].long().tolist())) == [0, 2, 3]  # s1 has no slot left
    layer = eviction_scene(14)  # evict 2: both from s1 (a sentence may be cut partway)
    kept = layer.meta["pos"][0, 0, :14].tolist()
    assert set(range(16)) - set(kept) <= {4, 5, 6, 7} and len(kept) == 14 == int(layer.lengths)


def test_defaults_and_validation():
    policy = make_policy("skipkv", budget=256)
    assert (policy.interval, policy.recent, policy.sinks, policy.compress_prefill) == (128, 8, 0, False)
    assert make_policy("skipkv", budget=64).interval == 32  # capped at budget // 2
    assert (policy.scorer.sigma, policy.scorer.tau) == (0.1, 0.95)
    for bad in ({"sigma": 1.5}, {"group_pool": "mean"}, {"redundancy": "x"}, {"window": 0}):
        with pytest.raises(ValueError):
            make_policy("skipkv", budget=64, **bad)

def test_without_attach_only_the_token_level_score_is_used():
    """Driven outside generate (or by a wrapper that does not forward attach), P is empty."""
    e = torch.eye(4)
    attached = SkipKV(window=3)
    attached.sentences = table_with([e[0], e[1], e[0]], [2, 3, 2])  # s0 penalised by 1.0
    bare = SkipKV(window=3)
    layer = one_layer(bare, torch.arange(8)[None], window=3)
    with pytest.warns(RuntimeWarning, match="attach"):
        token_level = bare.score(layer, torch.tensor([8]))
    assert (layer.meta["sent"] == -1).all()  # nothing labelled
    full = attached.score(layer, torch.tensor([8]))
    torch.testing.assert_close(token_level - full, torch.tensor([1.0, 1.0] + [0.0] * 6).view(1, 1, 8)[..., :full.shape[-1]])


# ---------------------------------------------------------------------------- bundled model
def run(smollm, policy, n):
    model, tok = smollm
    return generate(model, tok, [SHORT, MEDIUM], policy, GenerateConfig(max_new_tokens=n))


def test_budget_at_least_length_reproduces_full_greedy(smollm):
    full = run(smollm, None, 24)
    policy = make_policy("skipkv", budget=4096, interval=8)
    skip = run(smollm, policy, 24)
    assert skip.token_ids == full.token_ids
    assert all(s.compression_events == 0 for s in skip.stats)
    model, tok = smollm
    assert not model.get_decoder().norm._forward_hooks  # the hidden-state read is gone after the call
    # the table saw every fed token: prompt + all generated tokens but the last (never fed)
    delim = set(vocab_ids(tok, DELIMITERS).tolist())
    prompts = encode_prompts(tok, [SHORT, MEDIUM], GenerateConfig())
    fed = [p + g[:-1] for p, g in zip(prompts, full.token_ids)]
    assert policy.scorer.sentences.open.tolist() == [sum(t in delim for t in f) for f in fed]
    assert policy.scorer.sentences.count.sum(1).tolist() == [len(f) for f in fed]


def test_small_budget_stays_within_budget_plus_interval(smollm, monkeypatch):
    """Each compression (seen per layer through ``compress_layer``, which the engine's
    ``Schedule`` calls for every layer over budget) cuts the layer from at most budget +
    interval down to the budget, with every live slot labelled and sentence ids in order."""
    budget, interval = 48, 8
    calls, original = [], schedule_module.compress_layer

    def watched(layer, policy, layer_budget, seen_tokens, *prompt):
        before = layer.lengths.clone()
        original(layer, policy, layer_budget, seen_tokens, *prompt)
        sent, live = layer.meta["sent"], layer.live()  # every live slot labelled, sentence ids in position order
        assert (sent[live] >= 0).all() and (sent[~live] == -1).all()
        assert (sent[..., 1:][live[..., 1:]] >= sent[..., :-1][live[..., 1:]]).all()
        calls.append((tuple(seen_tokens.tolist()), before, layer.lengths.clone()))

    monkeypatch.setattr(schedule_module, "compress_layer", watched)
    result = run(smollm, make_policy("skipkv", budget=budget, interval=interval), 40)
    assert calls
    for _, before, after in calls:
        assert (before <= budget + interval).all()
        assert torch.equal(after, before.clamp(max=budget))  # down to the budget
    events = {seen for seen, *_ in calls}
    layers = smollm[0].config.num_hidden_layers
    assert len(calls) == layers * len(events)  # every layer at every event
    for stat in result.stats:  # 3 kv heads per layer
        assert stat.peak_kv_tokens == [3 * (budget + interval)] * layers and stat.compression_events == len(events)
