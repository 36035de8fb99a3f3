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

Comparisons at a token budget B (``make_policy("lagkv", budget=B)``): the paper has no budget
rule, so ``fit_budget`` is kvsieve's.  It fits (L, r) to the run's horizon N (longest prompt +
max new tokens) by the cache's peak over n = 1 .. N fed tokens (``peak_tokens``: Eq. 10 after
each compression and S + k(q - 2) + 2L tokens the moment one falls due, q = floor((n - S)/L)):

1. N <= B: nothing has to go; r = 1 (no compression).
2. Sec. 3.1's grid, L in {128, 512, 1024} and r in {1/2, 1/4, 1/6, 1/8} (S = 16 in the paper):
   among the settings whose peak is at most B and at least ``min_fill`` * B, the largest rL
   (Sec. 3.3 / Fig. 2: the method fails when rL is small), then the fuller peak, then larger L.
3. Otherwise off the grid, said so in ``fit_note`` and ``in_paper_grid`` (False; both in the
   policy's settings and every result row): any L with S + 2L <= B and the largest integer
   k = rL that keeps the peak within B, ranked as in 2.  Below B = S + 2 * 128 = 272 no grid
   setting fits: each compresses nothing until it holds S + 2L >= 272 tokens.
4. When even k = 1 cannot stay within B (N far beyond B), the smallest peak that k = 1 allows;
   the run exceeds B and ``fit_note`` says by how much (result rows carry ``peak_kv_tokens``).

Schedule: by default compress after the whole prompt (Sec. 3.1), then whenever a partition
completes while decoding.  Chunked prefill (Sec. 3.4: chunks of S + 2L, then L):
``make_policy("lagkv", prefill_block=c)``, blocks of c tokens with c dividing S and L
(``scorer.paper_prefill_chunk`` = gcd(S, L)), so a block ends at every n = S + jL where a
compression falls due: the paper's schedule for unpadded rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..policy import Scorer, check_choice, register
from ._lag import DueTable, find_tail, gather_partitions, lag_score, to_slots

PAPER_LAGS = (128, 512, 1024)  # Sec. 3.1 "Parameter Spaces": L = 128, 512 and 1024
PAPER_RATIOS = (1 / 2, 1 / 4, 1 / 6, 1 / 8)  # Sec. 3.1: 2x, 4x, 6x and 8x, "r = 0.5, 0.25, 0.167, and 0.125"


def kept_tokens(lag: int, ratio: float) -> int:
    """k: tokens kept per compressed partition, round(r * L), at least one."""
    return max(1, round(ratio * lag))


def peak_tokens(sinks: int, lag: int, kept: int, horizon: int) -> int:
    """Most tokens a row's cache holds while n = 1 .. ``horizon`` tokens arrive one at a time.

    Below S + 2L nothing is compressed (Sec. 2.2); from there on a compression falls due each
    time the tail after the sinks and frozen partitions reaches 2L tokens, at n = S + qL, when
    the cache holds S + k(q - 2) + 2L tokens, and leaves Eq. (10)'s length, which then grows by
    one per token until the next.  So the peak is the larger of the last such moment and the
    horizon's own Eq. (10) length.  k >= L never compresses: the peak is the horizon."""
    if kept >= lag or horizon < sinks + 2 * lag:
        return horizon
    q, m = divmod(horizon - sinks, lag)
    return max(sinks + kept * (q - 2) + 2 * lag, sinks + kept * (q - 1) + lag + m)


def _largest_kept(sinks: int, lag: int, budget: int, horizon: int) -> int:
    """The largest k in [1, L) whose ``peak_tokens`` is at most ``budget``, or 0 if none is
    (``horizon`` > ``budget``: k = L, no compression, never fits)."""
    if horizon < sinks + 2 * lag:  # never compressed: the peak is the horizon
        return 0
    q, m = divmod(horizon - sinks, lag)  # q >= 2
    k = min(lag - 1, (budget - sinks - lag - m) // (q - 1))  # Eq. (10) at the horizon
    if q > 2:
        k = min(k, (budget - sinks - 2 * lag) // (q - 2))  # the moment of the last compression
    elif sinks + 2 * lag > budget:
        return 0
    return max(k, 0)


def _ratio_text(ratio: float) -> str:
    inverse = 1 / ratio
    return f"1/{round(inverse)}" if math.isclose(inverse, round(inverse)) else f"{ratio:.4g}"


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
    min_fill : float, default 0.8
        Budget fit only (module docstring): a Sec. 3.1 grid setting is taken only if its peak
        uses at least this share of the budget; below it the fit leaves the grid (and says so).
        kvsieve's choice, not the paper's (which has no budget): 0.8 is issue 28's bar for "uses
        the budget" in budget-matched comparisons.
    in_paper_grid : bool, derived
        Whether (L, r) is one of Sec. 3.1's settings (L in {128, 512, 1024}, r in {1/2, 1/4, 1/6,
        1/8}); recomputed from ``lag`` and ``ratio`` (a value passed in is replaced).  In the
        policy's settings, so result rows say when a budget fit left the grid.
    fit_note : str, default ""
        Set by ``fit_budget``: which rule chose (L, r), the peak it allows, and why the grid was
        left when it was; "" when L and r were not fitted to a budget.
    """

    summary = ("attention-free: per-partition top r*L by K/V statistics relative to the next partition; "
               "a --budget picks (L, r) from the paper's grid when one fits (else off-grid, flagged)")
    source = ("arXiv:2504.04704 Sec. 2.2, 3.1 (S=16, L in {128,512,1024}, r in {1/2..1/8}), App. A.2; "
              "--budget B: kvsieve's fit (no rule in the paper): Sec. 3.1 grid with Eq. 10's peak in "
              "[min_fill*B, B], else off-grid with in_paper_grid=False and fit_note in the rows")
    uses_budget = False
    default_protect_prompt = False  # Sec. 2.2, Fig. 1: partitions run over prompt and output alike (refused if set)
    fits_budget = True  # a budget is mapped to (L, r) by fit_budget
    fitted_fields = ("lag", "ratio", "in_paper_grid", "fit_note")
    default_sinks = 16
    sinks: int = 16
    lag: int = 128
    ratio: float = 0.25
    reference: str = "next"
    statistic: str = "lag"
    skip_layers: int = 0
    min_fill: float = 0.8
    in_paper_grid: bool = True
    fit_note: str = ""
    _due: DueTable = field(default_factory=DueTable, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.sinks < 0 or self.lag < 1 or self.skip_layers < 0:
            raise ValueError(f"{self.name}: need sinks >= 0, lag >= 1 and skip_layers >= 0, "
                             f"got {self.sinks}, {self.lag}, {self.skip_layers}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"{self.name}: ratio r must be in (0, 1], got {self.ratio}")
        if not 0 <= self.min_fill <= 1:
            raise ValueError(f"{self.name}: min_fill must be in [0, 1], got {self.min_fill}")
        check_choice(self.reference, ("next", "self"), f"{self.name} reference")
        check_choice(self.statistic, ("lag", "key_norm"), f"{self.name} statistic")
        self.in_paper_grid = self.lag in PAPER_LAGS and any(math.isclose(self.ratio, r) for r in PAPER_RATIOS)

    @property
    def kept(self) -> int:
        """k: tokens kept per compressed partition (at least one)."""
        return kept_tokens(self.lag, self.ratio)

    def fit_budget(self, budget: int, horizon: int) -> "LagKV":
        """kvsieve's budget-to-(L, r) rule (module docstring, steps 1-4): S stays, L and r are
        refitted, and ``fit_note`` / ``in_paper_grid`` say where they came from."""
        S = self.sinks
        if budget - S < 4:
            raise ValueError(f"{self.name}: budget {budget} leaves no room after {S} sinks; "
                             f"raise --budget to at least {S + 4} or lower sinks")
        over = f"budget {budget}, horizon {horizon} tokens, S={S}"
        if horizon <= budget:  # step 1
            return replace(self, ratio=1.0, fit_note=f"{over}: the horizon fits, nothing has to go (r = 1)")
        least = self.min_fill * budget
        grid = []  # step 2
        for L in PAPER_LAGS:
            for r in PAPER_RATIOS:
                k = kept_tokens(L, r)
                peak = peak_tokens(S, L, k, horizon)
                grid.append((least <= peak <= budget, k, peak, L, r))
        fits = [g[1:] for g in grid if g[0]]
        if fits:
            k, peak, L, r = max(fits)
            return replace(self, lag=L, ratio=r, fit_note=(
                f"{over}: Sec. 3.1 grid L={L}, r={_ratio_text(r)} (k={k}) peaks at {peak} tokens"))
        within = [g[1:] for g in grid if g[2] <= budget]
        if within:
            k, peak, L, r = max(within, key=lambda g: g[1])
            why = (f"the fullest grid setting (L={L}, r={_ratio_text(r)}) peaks at only {peak} "
                   f"< {self.min_fill:g} * budget")
        else:
            why = "every grid setting peaks above the budget"
            if budget < S + 2 * PAPER_LAGS[0]:
                why += f" (each holds S + 2L >= {S + 2 * PAPER_LAGS[0]} tokens before it first compresses)"
        off = []  # step 3: any L whose window fits, the largest k that keeps the peak within B
        for L in range(2, (budget - S) // 2 + 1):
            k = _largest_kept(S, L, budget, horizon)
            if k:
                off.append((k, peak_tokens(S, L, k, horizon), L))
        full = [c for c in off if c[1] >= least]
        if full or off:
            k, peak, L = max(full) if full else max(off, key=lambda c: (c[1], c[0], c[2]))
            short = "" if full else f" (below {self.min_fill:g} * budget: no setting fills it)"
            return replace(self, lag=L, ratio=k / L, fit_note=(
                f"{over}: OFF the paper's grid, {why}; kvsieve's fit L={L}, k={k} (r={k}/{L}) "
                f"peaks at {peak} tokens{short}"))
        # step 4: no k >= 1 keeps the peak within B; the L with the smallest peak at k = 1
        peak, L = min((peak_tokens(S, L, 1, horizon), -L) for L in range(2, (horizon - S) // 2 + 1))
        L = -L
        return replace(self, lag=L, ratio=1 / L, fit_note=(
            f"{over}: OFF the paper's grid and OVER the budget: no setting keeps the peak within it "
            f"(one token per partition at least); L={L}, k=1 peaks at {peak} tokens, the fewest possible"))

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
    source = "arXiv:2504.04704 App. A.2, Eqs. 12-13 (A.2 runs use S=16, L=1024); --budget: lagkv's fit"
    reference: str = "self"


@register("lagkv-l2")
@dataclass
class LagKVL2(LagKV):
    """LagKV's partitions scored by -||K|| (App. A.2, Eq. 14); the first two layers are kept whole."""

    summary = "LagKV variant: per-partition top keys by smallest L2 norm; layers 0-1 uncompressed"
    source = ("arXiv:2504.04704 App. A.2, Eq. 14 (after Devoto et al. 2024: first two layers skipped); "
              "--budget: lagkv's fit")
    statistic: str = "key_norm"
    skip_layers: int = 2
