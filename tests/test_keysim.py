"""Key-similarity helpers shared by R-KV and SkipKV: the O(cap) and blocked forms equal the
pairwise definitions written out token by token, with and without the official code's
last-partner exemption (R-KV ``rkv/utils.py`` / SkipKV ``skipkv/utils.py`` ``cal_similarity``)."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvsieve.methods._keysim import (
    cosine_rows,
    mean_similarity_to_others,
    rkv_redundancy,
    softmax_similarity_mean,
    unit_keys,
)
from kvsieve.methods.rkv import RKV
from kvsieve.methods.skipkv import SkipKV


def _example():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 2, 7, 4, generator=g)
    keys[0, 1, 2] = 0.0  # a zero key: similarity 0 to everything
    live = torch.ones(2, 2, 7, dtype=torch.bool)
    live[1, 0, 4:] = False
    live[1, 1, 1:] = False  # a head with a single live key
    return keys, live


def _cos(a, b):
    na, nb = a.norm(), b.norm()
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def test_mean_similarity_to_others_is_the_pairwise_mean():
    keys, live = _example()
    got = mean_similarity_to_others(unit_keys(keys, live), live)
    for b in range(2):
        for h in range(2):
            alive = [i for i in range(7) if live[b, h, i]]
            for i in range(7):
                others = [j for j in alive if j != i]
                want = sum(_cos(keys[b, h, i], keys[b, h, j]) for j in others) / len(others) if i in alive and others else 0.0
                assert math.isclose(float(got[b, h, i]), want, abs_tol=1e-5)


def test_softmax_similarity_mean_matches_eq5_written_out_for_any_block():
    keys, live = _example()
    unit = unit_keys(keys, live)
    for b in range(2):
        for h in range(2):
            alive = [i for i in range(7) if live[b, h, i]]
            want = [0.0] * 7
            for i in alive:
                others = [j for j in alive if j != i]
                z = sum(math.exp(_cos(keys[b, h, i], keys[b, h, j])) for j in others)
                for j in others:
                    want[j] += math.exp(_cos(keys[b, h, i], keys[b, h, j])) / z / len(alive)
            for block in (1, 3, 256):
                got = softmax_similarity_mean(unit, live, block=block)[b, h]
                assert torch.allclose(got, torch.tensor(want), atol=1e-6), (b, h, block)


# ------------------------------------------------------------------ last-partner exemption


def _planted_example():
    """Small random keys in 3 dims (many pairs above 0.5 by chance) plus planted near-copies:
    2 rows x 3 kv heads x 11 slots, left padding, dead slots at the end, one dead slot holding a
    near-copy of a live key (it must never be a partner), a zero key."""
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(2, 3, 11, 3, generator=g)
    noise = 0.05 * torch.randn(2, 3, 11, 3, generator=g)
    for b, h, src, dst in [(0, 0, 1, 6), (0, 0, 1, 9), (0, 1, 2, 3), (1, 2, 4, 8), (1, 0, 5, 10)]:
        keys[b, h, dst] = keys[b, h, src] + noise[b, h, dst]
    keys[0, 2, 4] = 0.0
    live = torch.ones(2, 3, 11, dtype=torch.bool)
    live[1, :, :2] = False  # left padding of row 1
    live[0, 1, 8:] = False  # dead tail
    live[1, 0, 10] = False  # a dead near-copy of live slot 5
    return keys, live


def _edited_similarity(keys, live, b, h, threshold):
    """S for one (row, head) written out pair by pair: cosines between live keys (None on the
    diagonal and off the live set); with a threshold, each live row's cosine to the highest live
    slot j != i with cosine above it is set to 0 (R-KV's cal_similarity, retain_direction="last")."""
    cap = keys.shape[2]
    alive = [i for i in range(cap) if live[b, h, i]]
    s = {i: {j: _cos(keys[b, h, i], keys[b, h, j]) for j in alive if j != i} for i in alive}
    if threshold is not None:
        for i in alive:
            partners = [j for j in s[i] if s[i][j] > threshold]
            if partners:
                s[i][max(partners)] = 0.0
    return alive, s


def _rkv_reference(keys, live, threshold):
    out = torch.zeros(live.shape)
    for b in range(live.shape[0]):
        for h in range(live.shape[1]):
            alive, s = _edited_similarity(keys, live, b, h, threshold)
            n = len(alive)
            mean = {j: sum(s[i][j] for i in alive if i != j) / max(n - 1, 1) for j in alive}
            z = sum(math.exp(m) for m in mean.values())
            for j in alive:
                out[b, h, j] = math.exp(mean[j]) / z
    return out


def _eq5_reference(keys, live, threshold):
    out = torch.zeros(live.shape)
    for b in range(live.shape[0]):
        for h in range(live.shape[1]):
            alive, s = _edited_similarity(keys, live, b, h, threshold)
            for i in alive:
                z = sum(math.exp(v) for v in s[i].values())
                for j, v in s[i].items():
                    out[b, h, j] += math.exp(v) / z / len(alive)
    return out


@pytest.mark.parametrize("threshold", [0.5, 0.2, -0.3, None])
def test_rkv_redundancy_matches_the_pairwise_definition_for_any_block(threshold):
    keys, live = _planted_example()
    unit = unit_keys(keys, live)
    want = _rkv_reference(keys, live, threshold)
    for block in (1, 4, 64):
        torch.testing.assert_close(rkv_redundancy(unit, live, threshold, block=block), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("threshold", [0.5, -0.3, None])
def test_eq5_with_exemption_matches_the_pairwise_definition_for_any_block(threshold):
    keys, live = _planted_example()
    unit = unit_keys(keys, live)
    want = _eq5_reference(keys, live, threshold)
    for block in (1, 4, 64):
        got = softmax_similarity_mean(unit, live, block=block, threshold=threshold)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_the_default_threshold_is_the_official_half_and_changes_the_redundancy():
    keys, live = _planted_example()
    unit = unit_keys(keys, live)
    assert RKV().partner_threshold == 0.5 and SkipKV().partner_threshold == 0.5
    torch.testing.assert_close(rkv_redundancy(unit, live), _rkv_reference(keys, live, 0.5), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(rkv_redundancy(unit, live), rkv_redundancy(unit, live, None), atol=1e-4)


def test_planted_copies_lose_the_cosine_to_their_last_partner_and_the_latest_copy_scores_lowest():
    # one head of 8 orthogonal keys; slots 1, 4, 6 are near-copies of one key (cos ~0.99), slot 7
    # a dead near-copy too: rows 1 and 4 exempt slot 6, row 6 exempts slot 4, nothing else changes
    eye = torch.eye(8)
    keys = eye.clone()
    for j in (4, 6, 7):
        keys[j] = eye[1] + 0.1 * eye[j]
    keys = keys[None, None]  # [1, 1, 8, 8]
    live = torch.ones(1, 1, 8, dtype=torch.bool)
    live[0, 0, 7] = False
    unit = F.normalize(keys, dim=-1)  # the dead slot keeps its key: the live mask alone must exclude it
    raw = cosine_rows(unit, live, 0, 8, None)[0, 0]
    edited = torch.cat([cosine_rows(unit, live, start, start + 2, 0.5) for start in range(0, 8, 2)], dim=2)[0, 0]
    exempt = {(1, 6), (4, 6), (6, 4)}
    assert all(raw[i, j] > 0.9 for i, j in exempt)
    for i in range(8):
        for j in range(8):
            assert edited[i, j] == (0.0 if (i, j) in exempt else raw[i, j]), (i, j)
    red = rkv_redundancy(unit_keys(keys, live), live)[0, 0]
    assert red[6] < red[4] < red[1]  # the latest copy is the one kept
    assert red[0] == red[2] == red[3] == red[5]  # unrelated keys are untouched


def test_a_partner_threshold_outside_the_cosine_range_is_refused():
    with pytest.raises(ValueError, match="rkv partner_threshold"):
        RKV(partner_threshold=1.5)
    with pytest.raises(ValueError, match="skipkv partner_threshold"):
        SkipKV(partner_threshold=-2.0)
