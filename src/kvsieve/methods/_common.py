"""Steps and defaults shared by several methods, so that no method imports another's file.

* ``reduce_group``: query heads onto their kv head (GQA), the reduction each paper names.
* ``pool_along_sequence``: SnapKV-style pooling of scores along the slots (SnapKV, R-KV, SkipKV, AMS).
* ``LAZY_WINDOW``: LazyEviction's observation window W, also the recent window of its H2O baseline.
* ``PerQueryHeadScores``: what a base offers a wrapper that needs a score per query head (CAOTE).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

HEAD_REDUCTIONS = ("mean", "max", "sum")

# W, LazyEviction's observation window: the paper's value for GSM8K (Table 3; best of Table 9 on
# DS-Llama-8B).  Also the recent window of the paper's H2O baseline (App. C; ``h2o``
# recent_rule="lazy-window").
LAZY_WINDOW = 25


def reduce_group(x: torch.Tensor, how: str, dim: int = 2) -> torch.Tensor:
    """Reduce per-query-head values onto their kv head (GQA): 'mean', 'max' or 'sum'."""
    if how == "mean":
        return x.mean(dim=dim)
    if how == "max":
        return x.amax(dim=dim)
    if how == "sum":
        return x.sum(dim=dim)
    raise ValueError(f"unknown head reduction {how!r}; use 'mean', 'max' or 'sum'")


def pool_along_sequence(scores: torch.Tensor, live: torch.Tensor, kernel: int, how: str = "max") -> torch.Tensor:
    """1D pooling of [B, H, S] scores along S (stride 1, same length) over live slots only:
    dead slots neither contribute to nor dilute their neighbours' pools."""
    if how not in ("max", "avg"):
        raise ValueError(f"unknown pooling {how!r}; use 'max' or 'avg'")
    if kernel <= 1:
        return scores
    B, H, S = scores.shape
    pad = kernel // 2
    if how == "max":
        flat = scores.masked_fill(~live, float("-inf")).reshape(B * H, 1, S)
        pooled = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        both = torch.stack([scores * live, live.to(scores.dtype)], dim=2).reshape(B * H, 2, S)
        sums = torch.nn.functional.avg_pool1d(both, kernel, stride=1, padding=pad) * kernel
        pooled = sums[:, :1] / sums[:, 1:].clamp(min=1)
    return pooled[..., :S].reshape(B, H, S)


@runtime_checkable
class PerQueryHeadScores(Protocol):
    """A scorer that can give its scores before the reduction onto kv heads, [B, H_kv, G', cap]
    (G' = 1 when every query head of a group scores alike), without repeating K/V onto the query
    heads.  CAOTE's per-head errors (App. B.2) ask a base for them when it offers this (TOVA);
    other bases are scored on a view with every query head as its own kv head."""

    def score_per_query_head(self, layer, seen_tokens: torch.Tensor) -> torch.Tensor: ...
