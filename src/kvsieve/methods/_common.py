"""Steps and defaults shared by several methods, so that no method imports another's file.

* ``reduce_group``: query heads onto their kv head (GQA), the reduction each paper names.
* ``pool_along_sequence``: SnapKV-style pooling of scores along the slots (SnapKV, R-KV, SkipKV, AMS).
* ``LAZY_WINDOW``: LazyEviction's observation window W, also the recent window of its H2O baseline.
* ``PerQueryHeadScores``: what a base offers a wrapper that needs a score per query head (CAOTE).
* ``row_chunks``: a stack's rows a few at a time, so a scoring's large tensors stay in cache
  (Expected Attention's statistics, AMS's window attention).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

HEAD_REDUCTIONS = ("mean", "max", "sum")

# W, LazyEviction's observation window: the paper's value for GSM8K (Table 3; best of Table 9 on
# DS-Llama-8B).  Also the recent window of the paper's H2O baseline (App. C; ``h2o``
# recent_rule="lazy-window").
LAZY_WINDOW = 25

# Rows scored together: about 2 MiB of each row's largest tensor, so a chunk's copies and products
# stay in one core's L2 cache (4 MiB on the machine these numbers come from).  Expected Attention:
# 60 rows of 9 heads x 256 queries x 64 and 192 keys scored in 30-47 ms at once and 24-26 ms two to
# eight rows at a time (33 ms one row at a time); the worker's stacks are smaller (about 13 rows at
# 64 requests), where it gains 2-3% of a compaction (compaction benchmark).  AMS's window attention
# rows: chunks of 8 or 16 MiB made a 64-request compaction 2,430 and 3,270 ms, against 1,870-1,940
# at 1-4 MiB.  Each row's numbers are its own, so chunks give the same numbers as the whole stack.
CHUNK_BYTES = 2 << 20


def row_chunks(rows: int, row_bytes: int) -> list[slice]:
    """``rows`` rows as consecutive slices of about ``CHUNK_BYTES`` (``row_bytes`` each; one row at least)."""
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    return [slice(start, start + step) for start in range(0, rows, step)]


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
