"""Batch grouping by prefill length (SkipKV Sec. 4.3, Eq. 12).

Based on Tian et al., "SkipKV: Selective Skipping of KV Generation and Storage for Efficient
Inference with Large Reasoning Models" (arXiv:2512.07993); official code
github.com/TTTTTTris/SkipKV.  ``kvsieve bench grouping`` measures what it changes in kvsieve.
"""

from __future__ import annotations

from typing import Sequence


def group_by_prefill_length(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Sec. 4.3: sort prompts by prefill length, then cut into batches of ``batch_size``.

    Returns prompt indices per batch; run each batch with ``generate`` and scatter results
    back by index.  In kvsieve padding never counts against the budget (padding slots are
    dropped after prefill and budgets count live tokens per row), so Eq. 12's B' = B holds
    without grouping; grouping still removes padded prefill compute and prefill memory.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def padding_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Sum over prompts of Delta_pad = N_p^max - N_p within its batch (Eq. 12)."""
    return sum(max(lengths[i] for i in b) - lengths[i] for b in batches for i in b)
