"""Key redundancy from pairwise cosine similarity, shared by R-KV (``rkv``) and SkipKV (``skipkv``).

Both papers score a cached key by how similar it is to the other live keys of its (row, kv
head).  The similarity matrix is cap x cap per head, so neither function below materialises it
for the whole cache at once:

* ``mean_similarity_to_others`` needs no matrix at all: for unit keys k_i,
  sum_{j != i} k_i . k_j = k_i . (sum_j k_j) - k_i . k_i, one pass over the keys.
* ``softmax_similarity_mean`` (SkipKV Eq. 5: a softmax over each row, then the mean over rows)
  is inherently quadratic; it runs over blocks of ``block`` rows so the working set stays small
  (64 rows: fastest of 16-512 at 2176 keys, batch 8, on the 2-core CPU of DESIGN.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unit_keys(keys: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[B, H, cap, D] fp32 keys normalised to length 1, zero on dead slots (K-bar)."""
    return F.normalize(keys.float(), dim=-1) * live[..., None]


def mean_similarity_to_others(unit: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[B, H, cap]: each live key's mean cosine similarity to the *other* live keys of its head
    (0 on dead slots and for a head's only key).  unit: ``unit_keys`` output; live: [B, H, cap]."""
    total = unit.sum(dim=2, keepdim=True)  # [B, H, 1, D]: dead slots are zero vectors
    to_all = (unit * total).sum(-1)  # k_i . sum_j k_j
    self_sim = unit.square().sum(-1)  # k_i . k_i (1, or 0 for a zero key)
    others = (live.sum(-1, keepdim=True) - 1).clamp(min=1)
    return ((to_all - self_sim) / others) * live


def rkv_redundancy(unit: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[B, H, cap]: R-KV's redundancy, the softmax over live tokens of each key's mean cosine
    similarity to the others (0 on dead slots)."""
    mean_sim = mean_similarity_to_others(unit, live)
    return mean_sim.masked_fill(~live, float("-inf")).softmax(dim=-1).nan_to_num(0.0)


def softmax_similarity_mean(unit: torch.Tensor, live: torch.Tensor, block: int = 64) -> torch.Tensor:
    """[B, H, cap]: R_j = (1 / n) sum_i softmax_{j' != i, live}(k_i . k_j')_j over live rows i
    (SkipKV Eq. 5; n live keys; a row with no other live key contributes nothing).

    Cosines lie in [-1, 1], so exp() needs no max subtraction; with E_ij = exp(k_i . k_j) (0 on
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
        e = torch.matmul(unit[:, :, start:stop], unit.transpose(-1, -2)).exp_()  # [B, H, rows, cap]
        e.diagonal(offset=start, dim1=-2, dim2=-1).zero_()  # self pairs (i, i)
        z = torch.matmul(e, live_f[..., None]).squeeze(-1)  # [B, H, rows]: over live j != i
        weight = voters[..., start:stop] / z.clamp_(min=torch.finfo(z.dtype).tiny)
        out += torch.matmul(weight[:, :, None], e)  # the voting rows' sum of softmax rows
    return out.squeeze(2).mul_(live_f) / n_live.clamp(min=1)
