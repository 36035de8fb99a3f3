"""Key redundancy from pairwise cosine similarity, shared by R-KV (``rkv``) and SkipKV (``skipkv``).

Both papers score a cached key by how similar it is to the other live keys of its (row, kv
head).  The similarity matrix S = K-bar K-bar^T is cap x cap per head, so nothing below
materialises it for the whole cache at once: the quadratic forms run over blocks of ``block``
rows (64: fastest of 16-512 at 2176 keys, batch 8, on the 2-core CPU of DESIGN.md), and the
unthresholded mean needs no matrix at all (``mean_similarity_to_others``).

Last-partner exemption (``threshold``).  Both official codes edit S before aggregating it:
the diagonal is set to 0 and, in each row i, the cosine to i's *last* partner -- the highest
slot j != i with S_ij > threshold -- is set to 0 too (R-KV ``rkv/utils.py`` ``cal_similarity``
and SkipKV ``skipkv/utils.py`` ``cal_similarity_multi_batch``: ``threshold=0.5``,
``retain_direction="last"``).  The later copy of a near-duplicate pair thus loses the
redundancy its earlier partner lends it and is the one that survives.  Slots are in position
order for these (not ``slot_order_free``) scorers, so the last slot is the latest position.
``threshold=None`` skips the step: kvsieve's earlier reading, from the papers' text alone.

Where kvsieve departs from that code:

* deviation: a row with no partner above the threshold zeroes nothing.  The official code takes
  the largest index of ``where(S > t, j, 0)``, which is 0 for such a row, so it zeroes that row's
  cosine to slot 0 (a side effect: the first cached token's redundancy falls by one term per
  partnerless row).  Reproducing it changed no kept set in the runs measured below.
* dead (evicted / padding) slots are neither rows nor columns nor partners (the official
  SkipKV code zeroes padded keys, which then take part with cosine 0, and softmaxes over them).
* the mean over rows leaves the key itself out (divides by n - 1; the code divides by n with a
  0 on the diagonal, a softmax temperature n / (n - 1) apart).

Measured effect of the exemption (``scripts/keysim_effect.py``: SmolLM2-135M, the first 6 GSM8K
test questions, greedy, 256 new tokens, budget 64, threshold 0.5 vs None).  99.4-99.7% of live
keys have a partner above 0.5, so nearly every row exempts one.  rkv: 4 of 6 outputs change,
first at token 163-243 (90% of tokens equal); scoring each compression's cache both ways, the
unprotected kept sets overlap 99.85% and differ in 7.6% of (layer, row, kv head)s.  skipkv:
4 of 6 change, first at token 64-226 (73% equal); kept sets overlap 99.87%, differ in 6.8%.
Cost of one layer at cap 600 (3 kv heads, head_dim 64, one thread, the 2-core CPU shared, load
~4; medians): rkv's redundancy O(cap) -> O(cap^2) per head, batch 1 0.12 -> 8.5 ms, batch 8
0.9 -> 70 ms (as much as skipkv's Eq. 5 without it); skipkv's Eq. 5 batch 1 8.5 -> 15.4 ms,
batch 8 66 -> 122 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Default partner threshold: R-KV rkv/utils.py cal_similarity(threshold=0.5), the value R1KV's
# _compute_scores uses; SkipKV skipkv/utils.py cal_similarity_multi_batch(threshold=0.5), called
# by SkipKV.update_kv in skipkv/compression/skipkv.py.
PARTNER_THRESHOLD = 0.5


def unit_keys(keys: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[B, H, cap, D] fp32 keys normalised to length 1, zero on dead slots (K-bar)."""
    return F.normalize(keys.float(), dim=-1) * live[..., None]


def check_threshold(threshold: float | None, setting: str) -> None:
    """ValueError unless ``threshold`` is None or a cosine in [-1, 1]."""
    if threshold is not None and not -1.0 <= threshold <= 1.0:
        raise ValueError(f"{setting} must be None or a cosine in [-1, 1], got {threshold}")


def cosine_rows(unit: torch.Tensor, live: torch.Tensor, start: int, stop: int,
                threshold: float | None) -> torch.Tensor:
    """[B, H, stop - start, cap]: rows start..stop-1 of S = K-bar K-bar^T, with the diagonal set
    to 0 and, unless ``threshold`` is None, each live row's cosine to its last live partner above
    ``threshold`` set to 0 (the official ``cal_similarity``'s edit; see the module docstring)."""
    s = torch.matmul(unit[:, :, start:stop], unit.transpose(-1, -2))  # [B, H, rows, cap]
    s.diagonal(offset=start, dim1=-2, dim2=-1).zero_()  # self pairs (i, i)
    if threshold is None:
        return s
    partner = (s > threshold) & live[:, :, None, :] & live[:, :, start:stop, None]  # dead never partners
    partner.diagonal(offset=start, dim1=-2, dim2=-1).fill_(False)  # nor a key itself (threshold < 0)
    slot_1 = torch.arange(1, s.shape[-1] + 1, device=s.device, dtype=torch.int32)  # slot + 1
    last = (partner * slot_1).amax(-1, keepdim=True) - 1  # [B, H, rows, 1]: last partner, -1 if none
    # one write per row (a full-block masked_fill is ~4x slower): 0 at the partner, else unchanged
    at = last.clamp(min=0)
    return s.scatter_(-1, at, s.gather(-1, at).masked_fill_(last >= 0, 0.0))


def mean_similarity_to_others(unit: torch.Tensor, live: torch.Tensor, threshold: float | None = None,
                              block: int = 64) -> torch.Tensor:
    """[B, H, cap]: each live key j's mean over the *other* live keys i of S_ij (0 on dead slots
    and for a head's only key); S as edited by ``cosine_rows`` for this ``threshold``.

    unit: ``unit_keys`` output; live: [B, H, cap].  With ``threshold=None`` no matrix is needed:
    for unit keys, sum_{i != j} k_i . k_j = k_j . (sum_i k_i) - k_j . k_j, one pass over the
    keys.  With a threshold the column sums of the edited S are summed over blocks of rows.
    """
    others = (live.sum(-1, keepdim=True) - 1).clamp(min=1)  # [B, H, 1]
    if threshold is None:
        total = unit.sum(dim=2, keepdim=True)  # [B, H, 1, D]: dead slots are zero vectors
        column_sum = (unit * total).sum(-1) - unit.square().sum(-1)  # k_j . sum_i k_i - k_j . k_j
    else:
        column_sum = unit.new_zeros(live.shape)  # [B, H, cap]
        for start in range(0, unit.shape[2], block):
            stop = min(start + block, unit.shape[2])
            column_sum += cosine_rows(unit, live, start, stop, threshold).sum(dim=2)  # dead rows are 0
    return (column_sum / others) * live


def rkv_redundancy(unit: torch.Tensor, live: torch.Tensor, threshold: float | None = PARTNER_THRESHOLD,
                   block: int = 64) -> torch.Tensor:
    """[B, H, cap]: R-KV's redundancy, the softmax over live tokens of each key's mean cosine
    similarity to the others (0 on dead slots), the last partners exempted unless
    ``threshold`` is None (R-KV ``rkv/utils.py`` ``cal_similarity``: mean over rows, softmax)."""
    mean_sim = mean_similarity_to_others(unit, live, threshold, block)
    return mean_sim.masked_fill(~live, float("-inf")).softmax(dim=-1).nan_to_num(0.0)


def softmax_similarity_mean(unit: torch.Tensor, live: torch.Tensor, block: int = 64,
                            threshold: float | None = None) -> torch.Tensor:
    """[B, H, cap]: R_j = (1 / n) sum_i softmax_{j' != i, live}(S_ij')_j over live rows i
    (SkipKV Eq. 5; n live keys; a row with no other live key contributes nothing); S as edited
    by ``cosine_rows`` for this ``threshold`` (an exempted partner enters its row as cosine 0).

    Cosines lie in [-1, 1], so exp() needs no max subtraction; with E_ij = exp(S_ij) (0 on
    the diagonal) the softmax row i is E_i. / Z_i, Z_i = sum over live j of E_ij, and the sum of
    the voting rows is the matmul (voter_i / Z_i) E.  Dead columns are left out of Z by a matmul
    with the live mask and of R by the final mask, so the [rows, cap] block is written once
    (exp in place) and read twice.
    """
    B, H, cap, _ = unit.shape
    out = unit.new_zeros(B, H, 1, cap)
    live_f = live.to(unit.dtype)
    n_live = live.sum(-1, keepdim=True)  # [B, H, 1]
    voters = live_f * (n_live >= 2)  # [B, H, cap]: rows that vote
    for start in range(0, cap, block):
        stop = min(start + block, cap)
        e = cosine_rows(unit, live, start, stop, threshold).exp_()  # [B, H, rows, cap]
        e.diagonal(offset=start, dim1=-2, dim2=-1).zero_()  # self pairs (i, i) leave the softmax
        z = torch.matmul(e, live_f[..., None]).squeeze(-1)  # [B, H, rows]: over live j != i
        weight = voters[..., start:stop] / z.clamp_(min=torch.finfo(z.dtype).tiny)
        out += torch.matmul(weight[:, :, None], e)  # the voting rows' sum of softmax rows
    return out.squeeze(2).mul_(live_f) / n_live.clamp(min=1)
