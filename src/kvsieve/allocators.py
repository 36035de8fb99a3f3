"""Allocators: how a budget is split over layers and kv heads.

``select(scores, budget, k)`` gets scores [B, H_kv, S] (+inf protected, -inf dead) and the
layer's budget, and returns a keep mask [B, H_kv, S] and the largest per-head count if it is
known on the host (``k``) or ``None`` when counts are data dependent.

AMS's mass segments (``kvsieve.methods._segments.SegmentQuotas``) allocate too, but from a per-token mass
that these scores do not carry, so ``ams:<base>`` owns one and it is not registered here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

ALLOCATORS: dict[str, type] = {}


def register_allocator(cls):
    ALLOCATORS[cls.name] = cls
    return cls


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B, H, S] bool mask of each row-head's ``k`` highest scores."""
    idx = scores.topk(min(k, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


@register_allocator
@dataclass
class Uniform:
    """Every layer and kv head keeps ``budget`` tokens."""

    name: ClassVar[str] = "uniform"
    ragged_heads: ClassVar[bool] = False  # may kv heads of a layer keep different numbers of tokens?
    same_layer_budgets: ClassVar[bool] = True  # does every layer get the same budget?
    summary: ClassVar[str] = "same budget for every layer and kv head"
    source: ClassVar[str] = "kvsieve default"

    def layer_budgets(self, budget: int, num_layers: int, protected: int) -> list[int]:
        return [budget] * num_layers

    def select(self, scores: torch.Tensor, budget: int, k: int):
        return top_k_mask(scores, k), k


@register_allocator
@dataclass
class Pyramid(Uniform):
    """PyramidKV (Cai et al., 2024, arXiv:2406.02069): per-layer budgets fall linearly with depth.

    The evictable part ``budget - protected`` runs from ``2c - c/beta`` at layer 0 down to
    ``c/beta`` at the last layer, so budgets average to ``budget`` over layers.

    Parameters
    ----------
    beta : float, default 20
        Ratio of the mean to the smallest evictable budget (official PyramidKV code, ``beta=20``).
    """

    name: ClassVar[str] = "pyramid"
    same_layer_budgets: ClassVar[bool] = False
    summary: ClassVar[str] = "per-layer budgets falling linearly with depth"
    source: ClassVar[str] = "Cai et al. 2024 (arXiv:2406.02069); beta=20 from the official code"
    beta: float = 20.0

    def __post_init__(self):
        if self.beta < 1:
            raise ValueError(f"pyramid beta must be >= 1, got {self.beta}")

    def layer_budgets(self, budget: int, num_layers: int, protected: int) -> list[int]:
        c = budget - protected
        if num_layers == 1:
            return [budget]
        lo, hi = c / self.beta, 2 * c - c / self.beta
        step = (hi - lo) / (num_layers - 1)
        return [protected + max(0, round(hi - i * step)) for i in range(num_layers)]


@register_allocator
@dataclass
class AdaKV:
    """Ada-KV (Feng et al., 2024, arXiv:2407.11550): heads of a layer share ``H_kv * budget``
    slots per row, taken by the highest scores across heads, so heads with concentrated
    attention give slots to heads with spread attention.

    Parameters
    ----------
    floor : float, default 0.2
        Share of ``budget`` every head keeps regardless (the safeguard; alpha = 0.2 in the
        Ada-KV paper's experiments).
    """

    name: ClassVar[str] = "adakv"
    ragged_heads: ClassVar[bool] = True
    same_layer_budgets: ClassVar[bool] = True
    summary: ClassVar[str] = "heads of a layer share slots by score (ragged per-head lengths)"
    source: ClassVar[str] = "Feng et al. 2024 (arXiv:2407.11550); floor alpha=0.2 from the paper"
    floor: float = 0.2

    def layer_budgets(self, budget: int, num_layers: int, protected: int) -> list[int]:
        return [budget] * num_layers

    def __post_init__(self):
        if not 0 <= self.floor <= 1:
            raise ValueError(f"adakv floor must be in [0, 1], got {self.floor}")

    def select(self, scores: torch.Tensor, budget: int, k: int):
        B, H, S = scores.shape
        guaranteed = top_k_mask(scores, int(self.floor * budget))
        boosted = scores.masked_fill(guaranteed & (scores > float("-inf")), float("inf"))
        flat = top_k_mask(boosted.reshape(B, 1, H * S), H * min(k, S))
        return flat.reshape(B, H, S), None


def make_allocator(name: str, **settings):
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; choose one of: {', '.join(ALLOCATORS)}")
    cls = ALLOCATORS[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"unknown allocator setting(s) {unknown} for {name!r}; allowed: {allowed}")
    return cls(**settings)
