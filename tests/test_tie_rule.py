"""One tie rule for every selection (``schedule.ranked``): scores first, then the newer position.

The reference is plain Python ``sorted`` on (score, position) pairs, written here; the scores are
small integers so ties come by the dozen, as LazyEviction's and RaaS's timestamps do."""

from __future__ import annotations

import torch

from kvsieve.schedule import ranked, top_k_indices


def _case(seed: int, B: int = 2, H: int = 3, S: int = 40):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (B, H, S), generator=g).float()  # [B, H, S], four values: many ties
    pos = torch.stack([torch.randperm(S, generator=g) for _ in range(B * H)]).view(B, H, S)  # slot order != position order
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
