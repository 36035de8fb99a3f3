"""Key-similarity helpers shared by R-KV and SkipKV: the O(cap) and blocked forms equal the
pairwise definitions written out token by token."""

import math

import torch

from kvsieve.methods._keysim import mean_similarity_to_others, softmax_similarity_mean, unit_keys


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
