"""LagKV: attention-free eviction from lag-relative statistics of the keys and values.

arXiv:2504.04704; official code: github.com/AI-Lab-China-Merchants-Bank/LagKV.

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
rule, so ``fit_budget`` (through ``Scorer.sized``) is kvsieve's.  It fits (L, r) to the run's horizon N (longest prompt +
max new tokens) by the cache's peak: the most tokens a row holds at the engine's compression
checks (``scheduled_peak``).  Fed one token at a time that is ``peak_tokens``: Eq. (10) after
each compression and S + k(q - 2) + 2L the moment one falls due, q = floor((n - S)/L).  The
engine checks less often: after each prefill block (``prefill_block`` c, Sec. 3.4) and every
``interval`` decode steps, so a compression that falls due between two checks waits for the
next and the peak grows by up to c - 1 (resp. interval - 1) tokens; with the defaults (whole
prompt, interval 1) it does not.  The one moment a fit cannot bound is the whole prompt, held
until its compression after prefill (Sec. 3.1) as with every method that compresses after
prefill: a prompt longer than B is the run's peak, and ``fit_note`` says so.  Layers a variant
never compresses (``lagkv-l2``'s first two) hold every token; the fit bounds the others.

1. N <= B: nothing has to go; r = 1 (no compression).
2. Sec. 3.1's grid, L in {128, 512, 1024} and r in {1/2, 1/4, 1/6, 1/8} (S = 16 in the paper):
   among the settings whose peak is at most B and at least ``min_fill`` * B, the largest rL
   (Sec. 3.3 / Fig. 2: the method fails when rL is small), then the fuller peak, then larger L.
   When settings fit but none fills ``min_fill`` * B, the same rule over those that fit (the
   grid kept, ``fit_note`` says it under-fills), unless ``off_grid`` finds a fuller one in 3.
3. ``off_grid`` only (kvsieve's extension, False by default): any L with S + 2L <= B and the
   largest integer k = rL that keeps the peak within B, ranked as in 2.  ``fit_note`` and
   ``in_paper_grid`` (False; both in the policy's settings and every result row) say so.
   Below the grid such fits keep a few tokens per partition: rL under the grid's smallest
   (16), the regime Sec. 3.3 and Fig. 2 find failing.
4. Otherwise a ValueError that names the smallest budget that fits at this horizon: in the
   grid (raise the budget, or set ``off_grid``), or with ``off_grid`` off it (at least one
   token kept per partition).  No setting is ever fitted over B.

The smallest grid setting, L = 128 and r = 1/8 (k = 16), holds S + 2L = 272 tokens before it
first compresses, so no budget under 272 fits the grid, and the least that does grows by about
16 tokens per 128 of horizon: 320 at N = 700, 340 at N = 900, 400 at N = 1300 (S = 16, the
default schedule).

Schedule: by default compress after the whole prompt (Sec. 3.1), then whenever a partition
completes while decoding.  Chunked prefill (Sec. 3.4: chunks of S + 2L, then L):
``make_policy("lagkv", prefill_block=c)``, blocks of c tokens with c dividing S and L
(``scorer.paper_prefill_chunk`` = gcd(S, L)), so a block ends at every n = S + jL where a
compression falls due: the paper's schedule for unpadded rows.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from ..checks import SettingError
from ..policy import About, Defaults, Needs, Scorer, check_choice, register
from ..schedule import Feed
from ._lag import DueTable, find_tail, gather_partitions, lag_score, to_slots

PAPER_LAGS = (128, 512, 1024)  # Sec. 3.1 "Parameter Spaces": L = 128, 512 and 1024
PAPER_RATIOS = (1 / 2, 1 / 4, 1 / 6, 1 / 8)  # Sec. 3.1: 2x, 4x, 6x and 8x, "r = 0.5, 0.25, 0.167, and 0.125"


def kept_tokens(lag: int, ratio: float) -> int:
    """k: tokens kept per compressed partition, round(r * L), at least one."""
    return max(1, round(ratio * lag))


def kept_after(sinks: int, lag: int, kept: int, seen: int) -> int:
    """Tokens a row's cache holds right after a check at ``seen`` tokens that compresses every
    partition due (Sec. 2.2's recursion), whatever the earlier checks were, as long as each of
    them did the same: Eq. (10)'s ``S + k(q - 1) + L + m`` with q, m = divmod(n - S, L) once
    n >= S + 2L (the sinks, q - 1 frozen partitions of k tokens, the last full partition and the
    remainder), n below it (nothing compressed yet).  k >= L never compresses: n.

    The one count rule of LagKV's schedule: ``peak_tokens`` (the cache's size) and the scorer's
    ``Needs.count_rule`` (what a paged engine's scheduler fixes before the step, kvsieve.vllm)
    both read it; ``LagKV.select`` reaches the same count from the slots (``find_tail``)."""
    if kept >= lag or seen < sinks + 2 * lag:
        return seen
    q, m = divmod(seen - sinks, lag)
    return sinks + kept * (q - 1) + lag + m


def peak_tokens(sinks: int, lag: int, kept: int, horizon: int) -> int:
    """Most tokens a row's cache holds while n = 1 .. ``horizon`` tokens arrive one at a time.

    Below S + 2L nothing is compressed (Sec. 2.2); from there on a compression falls due each
    time the tail after the sinks and frozen partitions reaches 2L tokens, at n = S + qL, when
    the cache holds S + k(q - 2) + 2L tokens, and leaves Eq. (10)'s length, which then grows by
    one per token until the next.  So the peak is the larger of the last such moment and the
    horizon's own Eq. (10) length.  k >= L never compresses: the peak is the horizon."""
    if kept >= lag or horizon < sinks + 2 * lag:
        return horizon
    q = (horizon - sinks) // lag
    return max(sinks + kept * (q - 2) + 2 * lag, kept_after(sinks, lag, kept, horizon))


def scheduled_peak(sinks: int, lag: int, kept: int, horizon: int, feed: Feed) -> int:
    """Most tokens a row of at most ``horizon`` tokens holds under the engine's schedule ``feed``,
    the whole prompt's wait for its first check (``feed.held``) apart: the bound ``fit_budget``
    keeps within the budget, whatever the batch's other prompt lengths and padding.

    A check compresses every partition due (Sec. 2.2's recursion: the cache after it has Eq.
    (10)'s length whenever it comes), so between two checks at most ``burst`` tokens apart the
    cache follows ``peak_tokens`` until a compression falls due and then grows by at most
    ``burst`` - 1 tokens more before the next check comes.  Bursts are blocks of ``feed.block``
    prompt tokens (Sec. 3.4; left padding shifts where a row's partitions end within a block,
    so a padded row reaches the full ``block`` - 1 even when ``block`` divides S and L), then
    ``feed.interval`` decode steps.  With the defaults (the prompt whole, interval 1) this is
    ``peak_tokens``.  Never more than the row's own tokens; a row with a shorter prompt reaches
    fewer tokens and so no higher (``peak_tokens`` only grows with n)."""

    def checked_every(burst: int, n: int) -> int:
        return min(n, peak_tokens(sinks, lag, kept, n) + burst - 1)

    peak = checked_every(feed.interval, horizon)
    if feed.block is not None:  # an unknown prompt (0) may run to the horizon
        peak = max(peak, checked_every(feed.block, min(feed.prompt or horizon, horizon)))
    return peak


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
        The paper names no default; 128 is kvsieve's choice among the grid's L, taken from the
        kvpress port's ``lag_size`` (no other reason is recorded).  As the grid's smallest L it
        starts compressing soonest: at S + 2L = 272 tokens (2,064 at L = 1024).
    ratio : float, default 0.25
        Kept share r of each partition, k = round(r * L) tokens (Sec. 3.1 grid 1/2, 1/4, 1/6,
        1/8; Table 1).  r = 1 keeps everything and never compresses.  The paper names no
        default and the kvpress port has none (``compression_ratio`` 0): 1/4 (4x, Table 1's
        "L=128,r=4x" row) is kvsieve's choice among the grid's r, with no reason recorded.
    reference : str, default "next"
        "next": statistics of the next partition (Eqs. 5-6); "self": of the partition itself
        (LocalKV, Eqs. 12-13).
    statistic : str, default "lag"
        "lag": Eq. (9), score(K) + score(V); "key_norm": -||K|| (Eq. 14, ``lagkv-l2``).
    skip_layers : int, default 0
        The first ``skip_layers`` layers are never compressed (``lagkv-l2``: 2, App. A.2).
    min_fill : float, default 0.8
        Budget fit only (module docstring, step 2): the grid settings whose peak uses at least
        this share of the budget are preferred; when none does, the fit keeps the largest-rL
        one that fits and says so in ``fit_note`` (with ``off_grid``, an off-grid setting that
        does fill it is taken instead).  kvsieve's choice, not the paper's (which has no
        budget): 0.8 is issue 28's bar for "uses the budget" in budget-matched comparisons.
    off_grid : bool, default False
        Budget fit only (module docstring, step 3): allow L and r outside Sec. 3.1's grid when
        no grid setting fits the budget (or fills ``min_fill`` of it).  kvsieve's extension:
        off-grid fits at small budgets keep a few tokens per partition, the small-rL regime
        that Sec. 3.3 and Fig. 2 find failing, so a budget no grid setting fits is refused
        unless this is set.
    in_paper_grid : bool, derived
        Whether (L, r) is one of Sec. 3.1's settings (L in {128, 512, 1024}, r in {1/2, 1/4, 1/6,
        1/8}); recomputed from ``lag`` and ``ratio`` (a value passed in is replaced).  In the
        policy's settings, so result rows say when a budget fit left the grid.
    fit_note : str, default ""
        Set by ``fit_budget``: which rule chose (L, r), the peak it allows, and why the grid was
        left when it was; "" when L and r were not fitted to a budget.
    """

    about = About("attention-free: per-partition top r*L by K/V statistics relative to the next partition; "
                  "a --budget picks (L, r) from the paper's grid with its peak within the budget "
                  "(refused below the grid unless off_grid=true)",
                  "arXiv:2504.04704 Sec. 2.2, 3.1 (S=16, L in {128,512,1024}, r in {1/2..1/8}), App. A.2; "
                  "--budget B: kvsieve's fit (no rule in the paper): the Sec. 3.1 setting of largest rL whose "
                  "peak (Eq. 10 on the engine's schedule) is in [min_fill*B, B]; off the grid only with "
                  "off_grid=true (in_paper_grid=False and fit_note in the rows)")
    # no budget: select() keeps partitions; a budget is mapped to (L, r) by fit_budget
    # count_rule (set in __post_init__): every kv head keeps Eq. (10)'s count of the length, kept_after
    needs = Needs(uses_budget=False, selects=True, fitted_fields=("lag", "ratio", "in_paper_grid", "fit_note"))
    # protect_prompt False: Sec. 2.2, Fig. 1: partitions run over prompt and output alike (refused if set)
    defaults = Defaults(sinks=16, protect_prompt=False)
    sinks: int = 16
    lag: int = 128
    ratio: float = 0.25
    reference: str = "next"
    statistic: str = "lag"
    skip_layers: int = 0
    min_fill: float = 0.8
    off_grid: bool = False
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
        if not isinstance(self.off_grid, bool):
            raise ValueError(f"{self.name}: off_grid must be true or false, got {self.off_grid!r}")
        check_choice(self.reference, ("next", "self"), f"{self.name} reference")
        check_choice(self.statistic, ("lag", "key_norm"), f"{self.name} statistic")
        self.in_paper_grid = self.lag in PAPER_LAGS and any(math.isclose(self.ratio, r) for r in PAPER_RATIOS)
        # stacks_layers: scores and selections are per row; only the engine's should_compress reads the layer.
        # reads_values: Eq. (9) scores the values' statistics beside the keys'
        self.needs = replace(self.needs, whole_layers=self.skip_layers, stacks_layers=True, reads_values=True,
                             count_rule=partial(kept_after, self.sinks, self.lag, self.kept))

    @property
    def kept(self) -> int:
        """k: tokens kept per compressed partition (at least one)."""
        return kept_tokens(self.lag, self.ratio)

    def sized(self, horizon: int, feed: Feed, budget: int | None = None) -> tuple["LagKV", int]:
        """With ``budget``, (L, r) fitted to it first (``fit_budget``).  Without a budget the cache
        still peaks at Eq. (10)'s recursion on the engine's schedule (``scheduled_peak``): the
        capacity it ever needs, so it is never grown past."""
        fitted = self if budget is None else self.fit_budget(budget, horizon, feed)
        return fitted, scheduled_peak(fitted.sinks, fitted.lag, fitted.kept, horizon, feed)

    def fit_budget(self, budget: int, horizon: int, feed: Feed = Feed()) -> "LagKV":
        """kvsieve's budget-to-(L, r) rule (module docstring, steps 1-4) for rows of at most
        ``horizon`` tokens fed as ``feed`` says: S stays, L and r are refitted, and ``fit_note``
        / ``in_paper_grid`` say where they came from.  Raises a ValueError naming the smallest
        budget that fits when none within ``budget`` does."""
        S = self.sinks
        if budget - S < 4:
            raise SettingError("budget", f"{self.name}: budget {budget} leaves no room after {S} sinks; "
                                         f"raise {{name}} to at least {S + 4} or lower sinks")
        over = f"budget {budget}, horizon {horizon} tokens, S={S}"
        if horizon <= budget:  # step 1 (kvsieve's: r = 1 is no compression, outside the grid but exact)
            return replace(self, ratio=1.0, fit_note=f"{over}: the horizon fits, nothing has to go (r = 1)")

        def peak(L: int, k: int) -> int:
            return scheduled_peak(S, L, k, horizon, feed)

        least = self.min_fill * budget  # kvsieve's bar for using the budget (min_fill), not the paper's
        grid = [(k, peak(L, k), L, r)  # Sec. 3.1's 12 settings
                for L in PAPER_LAGS for r in PAPER_RATIOS for k in [kept_tokens(L, r)]]
        within = [g for g in grid if g[1] <= budget]
        full = [g for g in within if g[1] >= least]
        off = self._off_grid_fits(budget, peak) if self.off_grid and not full else []
        off_full = [c for c in off if c[1] >= least]
        if within and not off_full:  # step 2: largest k = rL first (Sec. 3.3 / Fig. 2), then the peak, then L
            k, top, L, r = max(full or within)
            hint = "" if self.off_grid else "; off_grid=true may fit one off the grid that does"
            short = "" if full else f" (under {self.min_fill:g} * budget: no grid setting fills it{hint})"
            return replace(self, lag=L, ratio=r, fit_note=(
                f"{over}: Sec. 3.1 grid L={L}, r={_ratio_text(r)} (k={k}) peaks at {top} tokens{short}"
                f"{self._prompt_note(budget, top, feed)}"))
        if off:  # step 3; deviation: the paper only runs Sec. 3.1's grid, this leaves it when asked (off_grid)
            k, top, L = max(off_full) if off_full else max(off, key=lambda c: (c[1], c[0], c[2]))
            why = ("no grid setting fits the budget" if not within else
                   f"no grid setting fills {self.min_fill:g} * budget")
            small = (f"; rL = {k} is under the grid's smallest (16), Sec. 3.3 / Fig. 2's failing regime"
                     if k < 16 else "")
            short = "" if off_full else f" (under {self.min_fill:g} * budget: no setting fills it)"
            return replace(self, lag=L, ratio=k / L, fit_note=(
                f"{over}: OFF the paper's grid (off_grid), {why}; kvsieve's fit L={L}, k={k} (r={k}/{L}) "
                f"peaks at {top} tokens{short}{small}{self._prompt_note(budget, top, feed)}"))
        # step 4: nothing fits; name the smallest budget that does at this horizon
        if not self.off_grid:
            least_grid = min(horizon, min(g[1] for g in grid))
            raise SettingError(
                "budget", f"{self.name}: budget {budget} at horizon {horizon} fits no setting of the paper's grid "
                f"(Sec. 3.1, S={S}); the smallest budget that fits is {least_grid}; raise {{name}}, or set "
                "off_grid=true to fit L and r outside the grid")
        least_any = min(horizon, min(peak(L, 1) for L in range(2, (horizon - S) // 2 + 1)))
        raise SettingError(
            "budget", f"{self.name}: budget {budget} at horizon {horizon} fits no setting even off the paper's grid "
            f"(one token kept per partition at least, S={S}); the smallest budget that fits is {least_any}; raise "
            "{name} or generate fewer tokens")

    def _off_grid_fits(self, budget: int, peak) -> list[tuple[int, int, int]]:
        """Step 3's candidates (k, peak, L): every L whose first compression fits (S + 2L <= B)
        with the largest k in [1, L) whose peak is within the budget (the peak only grows with k)."""
        fits = []
        for L in range(2, (budget - self.sinks) // 2 + 1):
            k = bisect.bisect_right(range(1, L), budget, key=lambda kept: peak(L, kept))  # ks 1 .. k fit
            if k:
                fits.append((k, peak(L, k), L))
        return fits

    @staticmethod
    def _prompt_note(budget: int, peak: int, feed: Feed) -> str:
        """``fit_note``'s word on the one moment the fit does not bound: the whole prompt, held
        until its compression after prefill (Sec. 3.1), when it outgrows the fitted peak."""
        if feed.held <= peak:
            return ""
        note = (f"; the longest prompt ({feed.prompt} tokens) is held whole until its compression after prefill "
                f"(Sec. 3.1), so the run peaks at {feed.held}")
        if feed.held > budget:
            note += (", over the budget as with every method that compresses after prefill (prefill_block "
                     "compresses it chunk by chunk, Sec. 3.4)")
        return note

    @property
    def paper_prefill_chunk(self) -> int:
        """Prefill chunk that reproduces Sec. 3.4's chunked prefill with ``prefill_block``."""
        return math.gcd(self.sinks, self.lag)

    def should_compress(self, layer, budget):
        """Host-side: can a partition have completed since this layer's last compression?"""
        if self.kept >= self.lag or layer.layer_idx < self.skip_layers:
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
    """LagKV with each partition normalised by its own min/max (App. A.2, Eqs. 12-13).

    A.2 runs at S = 16, L = 1024; the default stays ``lagkv``'s L = 128 (inherited, kvsieve's
    choice: the three variants share one L).  A.2's setting: ``lag=1024``."""

    about = About("LagKV variant: min/max of the partition itself (attention-free)",
                  "arXiv:2504.04704 App. A.2, Eqs. 12-13 (A.2 runs use S=16, L=1024); --budget: lagkv's fit")
    reference: str = "self"


@register("lagkv-l2")
@dataclass
class LagKVL2(LagKV):
    """LagKV's partitions scored by -||K|| (App. A.2, Eq. 14); the first two layers are kept whole.
    Its L defaults to 128 as ``localkv``'s does (see there); A.2's runs: ``lag=1024``."""

    about = About("LagKV variant: per-partition top keys by smallest L2 norm; layers 0-1 uncompressed",
                  "arXiv:2504.04704 App. A.2, Eq. 14 (after Devoto et al. 2024: first two layers skipped); "
                  "--budget: lagkv's fit")
    statistic: str = "key_norm"
    skip_layers: int = 2
