"""LagKV: attention-free eviction from lag-relative statistics of the keys and values.

Based on "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important"
(arXiv:2504.04704), Sec. 2.2.  After S sinks the cache is cut into partitions of L tokens.
Partition p is scored against the *next* one: each channel of its keys (and values) is
min/max normalised by partition p+1 (Eqs. 5-7), a token scores the softmax over the partition
of its normalised vector's std over channels (Eq. 8), keys plus values (Eq. 9); the top
k = r*L of every partition stay, per kv head.  Recursive: nothing is compressed below S + 2L
tokens, compressed partitions are frozen, and the last full partition plus the remainder is a
window of L + ((n - S) mod L) tokens, so n >= S + 2L tokens leave Eq. (10)'s
``S + rL(floor((n - S)/L) - 1) + L + (n - S) mod L``.  Variants (App. A.2): ``localkv``
normalises by the partition itself (Eqs. 12-13); ``lagkv-l2`` scores -||K|| (Eq. 14) and leaves
the first two layers whole.  No budget (``uses_budget`` False); never reads attention weights.

Comparisons at a token budget B (``make_policy("lagkv", budget=B)``): kvsieve's own rule, not
the paper's (``fit_budget``), picks L and r for the run's horizon N (longest prompt + max new
tokens) so that Eq. (10)'s peak stays within B: L is the largest power of two <= (B - S) / 4
(the window, < 2L tokens, takes at most half of what the sinks leave), then with
P = floor((N - S) / L) - 1 partitions compressed by the horizon, k = floor((B - S - 2L + 1) / P)
tokens per partition (at least 1, at most L) and r = k / L.  The peak is then at most
S + P k + 2L - 1 <= B; when even k = 1 does not fit, the run exceeds B and reports the peak
it reached (result rows carry it as ``peak_kv_tokens``).

Schedule: by default compress after the whole prompt (Sec. 3.1), then whenever a partition
completes while decoding.  Chunked prefill (Sec. 3.4: chunks of S + 2L, then L):
``make_policy("lagkv", prefill_block=True)`` with ``GenerateConfig(prefill_chunk=c)``, c
dividing S and L (``scorer.paper_prefill_chunk`` = gcd(S, L)), so a chunk ends at every
n = S + jL where a compression falls due: the paper's schedule for unpadded rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..policy import Scorer, check_choice, register
from ._lag import DueTable, find_tail, gather_partitions, lag_score, to_slots


@register("lagkv")
@dataclass
class LagKV(Scorer):
    """Lag-relative min/max statistics per partition.

    Parameters
    ----------
    sinks : int, default 16
        Sink size S, never evicted (Sec. 3.1 fixes S = 16; the kvpress port defaults to 4).
        Shared with the policy's ``sinks``: ``make_policy`` and ``--sinks`` set both.
    lag : int, default 128
        Partition (lag) size L (Sec. 3.1 grid {128, 512, 1024}; the kvpress port uses 128).
    ratio : float, default 0.25
        Kept share r of each partition, k = round(r * L) tokens (Sec. 3.1 grid 1/2, 1/4, 1/6,
        1/8; Table 1).  r = 1 keeps everything and never compresses.
    reference : str, default "next"
        "next": statistics of the next partition (Eqs. 5-6); "self": of the partition itself
        (LocalKV, Eqs. 12-13).
    statistic : str, default "lag"
        "lag": Eq. (9), score(K) + score(V); "key_norm": -||K|| (Eq. 14, ``lagkv-l2``).
    skip_layers : int, default 0
        The first ``skip_layers`` layers are never compressed (``lagkv-l2``: 2, App. A.2).
    """

    summary = "attention-free: per-partition top r*L by K/V statistics relative to the next partition"
    source = "arXiv:2504.04704 Sec. 2.2, 3.1 (S=16, L in {128,512,1024}, r in {1/2..1/8}), App. A.2"
    uses_budget = False
    fits_budget = True  # a budget is mapped to (L, r) by fit_budget
    fitted_fields = ("lag", "ratio")
    default_sinks = 16
    sinks: int = 16
    lag: int = 128
    ratio: float = 0.25
    reference: str = "next"
    statistic: str = "lag"
    skip_layers: int = 0
    _due: DueTable = field(default_factory=DueTable, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.sinks < 0 or self.lag < 1 or self.skip_layers < 0:
            raise ValueError(f"{self.name}: need sinks >= 0, lag >= 1 and skip_layers >= 0, "
                             f"got {self.sinks}, {self.lag}, {self.skip_layers}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"{self.name}: ratio r must be in (0, 1], got {self.ratio}")
        check_choice(self.reference, ("next", "self"), f"{self.name} reference")
        check_choice(self.statistic, ("lag", "key_norm"), f"{self.name} statistic")

    @property
    def kept(self) -> int:
        """k: tokens kept per compressed partition (at least one)."""
        return max(1, round(self.ratio * self.lag))

    def fit_budget(self, budget: int, horizon: int) -> "LagKV":
        """kvsieve's budget-to-(L, r) rule (module docstring): S stays, L and r are refitted."""
        room = budget - self.sinks
        if room < 4:
            raise ValueError(f"{self.name}: budget {budget} leaves no room after {self.sinks} sinks; "
                             f"raise --budget to at least {self.sinks + 4} or lower sinks")
        lag = 1 << ((room // 4).bit_length() - 1)  # largest power of two <= room / 4
        partitions = max(1, (horizon - self.sinks) // lag - 1)
        kept = min(lag, max(1, (room - 2 * lag + 1) // partitions))
        return replace(self, lag=lag, ratio=kept / lag)

    @property
    def paper_prefill_chunk(self) -> int:
        """Prefill chunk that reproduces Sec. 3.4's chunked prefill with ``prefill_block``."""
        return math.gcd(self.sinks, self.lag)

    def compresses_layer(self, layer_idx):
        return layer_idx >= self.skip_layers

    def should_compress(self, layer, budget):
        """Host-side: can a partition have completed since this layer's last compression?"""
        if self.kept >= self.lag or not self.compresses_layer(layer.layer_idx):
            return False
        return self._due.due(layer, first=self.sinks + 2 * self.lag)

    def score(self, layer, seen_tokens):
        """[B, H_kv, cap]: Eq. (9) (or Eq. 14) on the partitions compressed now, +inf elsewhere."""
        tail = find_tail(layer, seen_tokens, self.sinks, self.lag, self.kept)
        cap = layer.keys.shape[2]
        if tail.slots.shape[2] < 2:  # no partition with a successor fits in the cache
            return torch.full(layer.lengths.shape + (cap,), float("inf"), device=layer.keys.device)
        keys = gather_partitions(layer.keys, tail)  # [B, H, NP, L, D]
        if self.statistic == "key_norm":
            per_token = -keys[:, :, :-1].norm(dim=-1)  # Eq. (14)
        else:
            values = gather_partitions(layer.values, tail)
            per_token = lag_score(keys, self.reference) + lag_score(values, self.reference)  # Eq. (9)
        return to_slots(per_token, tail, cap, float("inf"))

    def select(self, layer, scores, budget, seen_tokens):
        """Keep the top k of every partition compressed now, and every other live token.

        One host read per compression (documented): the kept count K and when the next
        partition can complete, which is what ``should_compress`` compares ``max_len`` with."""
        tail = find_tail(layer, seen_tokens, self.sinks, self.lag, self.kept)
        live = layer.live()
        B, H, NP, L = tail.slots.shape
        keep = live
        if NP >= 2:
            part = scores.gather(2, tail.slots[:, :, :-1].reshape(B, H, -1)).view(B, H, NP - 1, L)
            top = part.topk(self.kept, dim=-1).indices
            kept_part = torch.zeros_like(part, dtype=torch.bool).scatter_(-1, top, True)
            keep = live & ~to_slots(~kept_part, tail, live.shape[-1], False)
        K, until_due = torch.stack([keep.sum(dim=-1).max(), (2 * self.lag - tail.after).min()]).tolist()
        self._due.set(layer, K + until_due)
        return keep, K


@register("localkv")
@dataclass
class LocalKV(LagKV):
    """LagKV with each partition normalised by its own min/max (App. A.2, Eqs. 12-13)."""

    summary = "LagKV variant: min/max of the partition itself (attention-free)"
    source = "arXiv:2504.04704 App. A.2, Eqs. 12-13 (A.2 runs use S=16, L=1024)"
    reference: str = "self"


@register("lagkv-l2")
@dataclass
class LagKVL2(LagKV):
    """LagKV's partitions scored by -||K|| (App. A.2, Eq. 14); the first two layers are kept whole."""

    summary = "LagKV variant: per-partition top keys by smallest L2 norm; layers 0-1 uncompressed"
    source = "arXiv:2504.04704 App. A.2, Eq. 14 (after Devoto et al. 2024: first two layers skipped)"
    statistic: str = "key_norm"
    skip_layers: int = 2
