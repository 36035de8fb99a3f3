"""One tie rule for every selection (``schedule.ranked``): scores first, then the newer position.

The reference is plain Python ``sorted`` on (score, position) pairs, written here; the scores are
small integers so ties come by the dozen, as LazyEviction's and RaaS's timestamps do.  ``ranked``
answers ``k == 1`` (the in-place eviction of every decode step) by a min/max reduction and any
other ``k`` by one ``topk`` over an int64 key, so every ``k`` from 1 to S is asked."""

from __future__ import annotations

import random

import torch

from kvsieve.cache import DEAD_POS
from kvsieve.schedule import ranked, top_k_indices

INF = float("inf")
POOL = (-INF, -2.5, -1.0, -0.0, 0.0, 0.5, 3.0, INF)  # both zeros, both infinities: exact in bf16 too


def _case(seed: int, B: int = 2, H: int = 3, S: int = 40):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (B, H, S), generator=g).float()  # [B, H, S], four values: many ties
    pos = torch.stack([torch.randperm(S, generator=g) for _ in range(B * H)]).view(B, H, S)  # slot order != position order
    return scores, pos


def _hard_case(seed: int, B: int = 2, H: int = 3):
    """Scores drawn from ``POOL`` (both signed zeros, both infinities), positions a permutation per
    row, and up to S dead slots per row at ``DEAD_POS`` scored -inf (as ``protect`` leaves them,
    what a keep-set ranks) or +inf (as ``evict_in_place`` makes them, what eviction ranks).  Dead
    slots share one (score, position): the rule cannot part them, so they are interchangeable."""
    rng = random.Random(seed)
    S = rng.choice((1, 2, 3, 9, 24))
    scores = torch.tensor([[[rng.choice(POOL) for _ in range(S)] for _ in range(H)] for _ in range(B)])
    pos = torch.tensor([[rng.sample(range(3 * S), S) for _ in range(H)] for _ in range(B)])
    for b in range(B):
        for h in range(H):
            for slot in rng.sample(range(S), rng.choice((0, 0, 1, S // 2, S))):
                pos[b, h, slot], scores[b, h, slot] = DEAD_POS, rng.choice((-INF, INF))
    return scores, pos


def _reference(scores, pos, k, largest):
    out = []
    for s_row, p_row in zip(scores.flatten(0, 1).tolist(), pos.flatten(0, 1).tolist()):
        slots = sorted(range(len(s_row)), key=lambda i: (s_row[i], p_row[i]), reverse=largest)
        out.append(slots[:k])
    return out


def test_ranked_is_score_then_newer_position_both_ways():
    for seed in range(5):
        scores, pos = _case(seed)
        for k in (1, 7, 25, 40):
            for largest in (True, False):
                got = ranked(scores, pos, k, largest=largest).flatten(0, 1).tolist()
                assert got == _reference(scores, pos, k, largest), (seed, k, largest)


def test_ranked_follows_the_rule_for_every_k_through_signed_zeros_infinities_and_dead_slots():
    """Every k from 1 to S, both ways, 200 random cases, float32 and bfloat16 scores: the slots
    ``ranked`` returns, in its order, hold the (score, position) pairs Python's ``sorted`` puts
    first (-0.0 == 0.0 there too), each slot once.  Where pairs are unique, as every live slot's
    is, that pins the very slot; only dead slots (one shared pair) may stand for each other."""
    for seed in range(200):
        scores, pos = _hard_case(seed)
        S = scores.shape[-1]
        pairs = [list(zip(s, p)) for s, p in zip(scores.flatten(0, 1).tolist(), pos.flatten(0, 1).tolist())]
        for largest in (True, False):
            order = _reference(scores, pos, S, largest)  # [B * H] rows, every slot ranked
            for dtype in (torch.float32, torch.bfloat16):
                for k in range(1, S + 1):
                    got = ranked(scores.to(dtype), pos, k, largest=largest).flatten(0, 1).tolist()
                    for row, (slots, want) in enumerate(zip(got, order)):
                        assert len(set(slots)) == k, (seed, largest, dtype, k, row)
                        assert [pairs[row][i] for i in slots] == [pairs[row][i] for i in want[:k]], \
                            (seed, largest, dtype, k, row)


def test_keeping_the_top_and_evicting_the_bottom_pick_complements_through_ties():
    """What an in-place engine evicts and a gathering engine keeps part the slots exactly."""
    scores, pos = _case(7)
    B, H, S = scores.shape
    keep = 29
    top = ranked(scores, pos, keep)  # [B, H, keep]
    bottom = ranked(scores, pos, S - keep, largest=False)  # [B, H, S - keep]
    for b in range(B):
        for h in range(H):
            assert sorted(top[b, h].tolist() + bottom[b, h].tolist()) == list(range(S))


def test_top_k_indices_keeps_the_ranked_slots_in_slot_order_and_drops_dead_ones():
    scores, pos = _case(3)
    scores[0, 0, :5] = float("-inf")  # five dead slots in one head
    kept, lengths = top_k_indices(scores, pos, 38)
    ref = _reference(scores, pos, 38, True)
    assert kept[0, 1].tolist() == sorted(ref[1])
    assert lengths[0, 0].item() == 35 and lengths[0, 1].item() == 38
    assert kept[0, 0, :35].tolist() == sorted(i for i in ref[0] if i >= 5)
