"""AMS: Adaptive Mass-Segmented KV compression, allocate-then-score around any base scorer.

arXiv:2605.23200; official code: github.com/EIT-NLP/AdaptiveMassSegment.

Based on Yang & Shen, "Adaptive Mass-Segmented KV Compression for Long-Form Reasoning" (AMS;
code github.com/EIT-NLP/AdaptiveMassSegment).  ``ams:<base>`` wraps any budgeted scorer; the
paper's bases are ``tova``, ``expected``, ``keydiff`` and ``rkv`` (Tables 1, 5); other bases
(``ams:lagkv``-style wrappers of kvsieve's own scorers) are kvsieve's extension.  At each
compression event, for every (row, kv head), vectorised over both (Algorithm 1, App. B.4):

1. quality mass (Sec. 3.2, Eq. 1, App. B.4): attention of the last W queries over the cache;
   each causally masked (query, key) observation is padded with the window's maximum; mean
   over the window, GQA reduction onto the kv head, average pooling along the sequence, then
   ``m_i = (max(u_i, 0) + eps) / sum_v (max(u_v, 0) + eps)`` (Eq. 1).
2. EMA credit (Sec. 3.3, Alg. 1 lines 6-9): ``c <- lam c + (1 - lam) m``,
   ``m_used = normalize(beta m + (1 - beta) normalize(c))``.  ``c`` is per-token metadata
   (``meta["ams_credit"]``): the engine's one gather compacts it with K/V, new tokens enter at 0.
3-5. segments, quotas and selection (Sec. 3.3, Alg. 1 lines 14-41) are allocation: the wrapper
   hands the mass to a ``kvsieve.methods._segments.SegmentQuotas`` built from its settings, which cuts it
   into segments, splits the budget T_keep into per-segment quotas and fills them by the base
   score (must-keep first, Sec. 3.3, or as Algorithm 1 orders it: ``order``); ``select``
   returns that keep mask and the engine gathers once (lines 43-44).

Schedule (App. B.2, Table 12): decode-only.  The prompt is prefilled whole
(``compress_prefill`` False, and ``prefill_block`` False, so that a base which reads the prompt
block-wise on its own, ``caote:``/``fastcaote:``, does not evict during prefill under ``ams:``)
and every ``interval`` = I generated tokens (Table 15: 512) each layer holding more than T_keep
is cut to exactly T_keep per (row, kv head), so the cache peaks at T_keep + I (at the first
event, prompt + I when the prompt is longer than T_keep).

Hidden-state buffer (Table 15: 256): in the released controller (kvpress ``DecodingPress``) the
last <= 256 hidden states of decoded tokens, emptied at every compression, from which a scorer
recomputes its queries (AMS's window W, Expected Attention's statistics).  kvsieve's engine
keeps each layer's last ``Needs.query_window`` post-RoPE queries instead: AMS asks for
max(W, the base's window) and hands the base only its own window; ``expected`` has its
``hs_buffer`` (256).  Gap (needs engine support): kvsieve's window is not emptied at a
compression, so when I < buffer it also holds queries from before the last event (and prompt
queries when fewer than W tokens were decoded); with the paper's I = 512 >= 256 >= W = 128 the
two agree.  The released W is also capped at buffer - 1 queries; kvsieve uses up to W.

Heads (Sec. 3.1): every kv head keeps its own tokens.  A base that averages scores over the
layer's kv heads slot by slot (``Needs.aligned_heads``, e.g. TOVA's default) would mix different
tokens once heads differ, so it scores each kv head as its own row (TOVA: its group mean).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..attention import window_attention
from ..cache import DEAD_POS
from ..policy import About, check_choice
from ._common import HEAD_REDUCTIONS, pool_along_sequence, reduce_group, row_chunks
from ._segments import SegmentQuotas, normalize
from . import register_wrapper
from ._wrapper import WrappingScorer

CREDIT = "ams_credit"  # per-token EMA credit (Sec. 3.3), compacted with K/V


# ---------------------------------------------------------------------------- Step 1-2: mass
def window_observations(window) -> tuple[torch.Tensor, torch.Tensor]:
    """What Eq. (1) reads of the attention ``probs`` [B, H, G, w, S] of ``window``'s recent queries
    over its cache (``attention.window_attention``): their sum over the queries [B, H, G, S] and
    their maximum over the window [B, H, G, 1], computed a few rows at a time (``row_chunks``):
    summed while in cache, so a stack's rows are bounded by its queries, not by these rows
    (``Needs.attends_window`` False)."""
    queries, keys = window.recent_queries, window.keys  # [B, H_q, w, D], [B, H, S, D]
    B, H, S = keys.shape[:3]
    G, w = queries.shape[1] // H, queries.shape[2]
    total, top = keys.new_empty(B, H, G, S, dtype=torch.float32), keys.new_empty(B, H, G, 1, dtype=torch.float32)
    for rows in row_chunks(B, H * G * w * S * 4):
        probs = window_attention(window, rows)  # [b, H, G, w, S]
        total[rows] = probs.sum(dim=-2)
        top[rows] = probs.amax(dim=(-1, -2))[..., None]
    return total, top


def quality_mass(probs, query_pos, key_pos, live, kernel: int, eps: float, padding: str = "missing",
                 head_reduction: str = "mean", observed: tuple | None = None) -> torch.Tensor:
    """Eq. (1) mass [B, H, S] from window attention ``probs`` [B, H, G, w, S] (App. B.4), or from
    what it reads of them, ``observed`` (``window_observations``; ``probs`` then None).

    query_pos [B, w] (DEAD_POS: padding query), key_pos and live [B, H, S].  "missing": each
    masked observation (key after the query) is the maximum observed in the window of that query
    head; "suffix" (released code): keys at or after the window's first query get the maximum
    pooled score.  Mean over real queries, GQA reduction, average pooling over live slots.
    ``probs`` must be zero where a query did not see a key and on padding queries' rows (as
    ``window_attention`` returns them), so the masked observations are counted, never gathered:
    sum over queries of (observed ? p : max) = sum of p + max * (real queries that missed the key).
    Slots may hold the tokens in any order: the pooling reads neighbours by position.
    """
    real = query_pos != DEAD_POS  # [B, w]
    n_real = real.sum(dim=-1).clamp(min=1)[:, None, None, None]  # [B, 1, 1, 1]
    # [B, H, G, S] and [B, H, G, 1]
    total, window_max = observed or (probs.sum(dim=-2), probs.amax(dim=(-1, -2))[..., None])
    if padding == "missing":
        total = total + window_max * missed_by(query_pos, key_pos)[:, :, None]  # dead keys: every query missed them
    usage = reduce_group(total / n_real, head_reduction)  # [B, H, S]
    order = key_pos.argsort(dim=-1, stable=True)  # [B, H, S] slots by position, dead slots (DEAD_POS) last
    pooled = pool_along_sequence(usage.gather(-1, order), live.gather(-1, order), kernel, "avg")
    usage = torch.empty_like(usage).scatter_(-1, order, pooled)
    if padding == "suffix":  # deviation: released code pads with one max over the whole batch (.item())
        first = query_pos.masked_fill(query_pos == DEAD_POS, torch.iinfo(torch.long).max).amin(dim=1)  # [B]
        top = usage.masked_fill(~live, float("-inf")).amax(dim=-1, keepdim=True)
        usage = torch.where(key_pos >= first[:, None, None], top, usage)
    mass = (usage.clamp(min=0) + eps) * live  # Eq. (1)
    return normalize(mass)


def missed_by(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """[B, H, S] int64: how many real queries of the window (query_pos [B, w], DEAD_POS on padding)
    come before each key (key_pos [B, H, S]), i.e. did not see it: a count by binary search over
    the sorted query positions instead of a [B, H, w, S] comparison.  A padding query (DEAD_POS)
    is never before a key, a dead key (DEAD_POS) after every real query."""
    B, H, S = key_pos.shape
    before = torch.searchsorted(query_pos.sort(dim=-1).values, key_pos.reshape(B, H * S), side="left")
    return before.view(B, H, S)


def ema_credit(credit, mass, live, lam: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sec. 3.3 / Alg. 1 lines 7-9: updated credit and the history-aware mass (live slots)."""
    credit = torch.where(live, lam * credit + (1 - lam) * mass, credit)
    return credit, normalize((beta * mass + (1 - beta) * normalize(credit * live)) * live)


# ---------------------------------------------------------------------------- the wrapper
@register_wrapper("ams")
@dataclass
class AMS(WrappingScorer):
    """Adaptive mass-segmented allocation around a base scorer (``ams:<base>``).

    Parameters (defaults: paper Table 15; settings the paper leaves open: released code)
    ----------
    base : dict
        Read-only report of the base scorer's settings (``WrappingScorer``); the base is set
        up by its own setting names, e.g. ``make_policy("ams:expected", budget=512, epsilon=0.05)``.
    mass_window : int, default 128
        W, recent queries of the quality mass (Table 15).  AMS's own settings that could clash
        with a base's (window, kernel, head_reduction, epsilon) are prefixed ``mass_``.
    delta : float, default 0.1
        Target segment mass Delta (Table 15).
    l_min, l_max : int, default 16, 256
        Segment length bounds (Table 15).  Both hold when l_max >= 2 l_min and T >= l_min.
    q_min : int, default 1
        Minimum quota per segment (Table 15).
    ema_lambda, ema_beta : float, default 0.9, 0.9
        EMA decay lambda and mixing beta of the credit (Table 15).
    use_credit : bool, default True
        EMA credit on (Sec. 3.3 calls it optional; Table 7 ablates it).
    mass_kernel : int, default 5
        Average-pooling kernel of the usage (App. B.4 "small"; released ``window_kernel_size=5``).
    mass_reduction : str, default "mean"
        Query heads onto their kv head (open in the paper; released: group mean).
    mass_epsilon : float, default 1e-12
        Eq. (1)'s epsilon ("a small constant"; released ``_to_mass`` eps 1e-12).
    padding : str, default "missing"
        "missing": masked observations padded with the window max (App. B.4); "suffix": the
        last window positions set to the max pooled score (released code).
    segmentation : str, default "row"
        "row": segments per (row, kv head) (Alg. 1); "batch": one segmentation per kv head
        from the batch-mean mass, shared by the rows (released code).
    order : str, default "sec3.3"
        Must-keep before quotas (Sec. 3.3) or quotas, then must-keep, then trim ("alg1").

    Schedule defaults (``schedule``, replacing the base's ``Defaults``): sinks 4 (Table 15), recent 32 (open; released
    ``always_keep_last=32``), interval I = 512 (Table 15), decode-only (App. B.2, Table 12:
    ``compress_prefill`` and ``prefill_block`` False, whatever the base's own schedule);
    ``protect_prompt`` False: the cache, prompt included, is capped at T_keep (App. B.1-B.2).
    """

    mass_window: int = 128
    delta: float = 0.1
    l_min: int = 16
    l_max: int = 256
    q_min: int = 1
    ema_lambda: float = 0.9
    ema_beta: float = 0.9
    use_credit: bool = True
    mass_kernel: int = 5
    mass_reduction: str = "mean"
    mass_epsilon: float = 1e-12
    padding: str = "missing"
    segmentation: str = "row"
    order: str = "sec3.3"
    allocation: SegmentQuotas = field(init=False, repr=False, compare=False)  # steps 3-5, from the fields above
    _raw: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    prefix: ClassVar[str] = "ams"
    about: ClassVar[About] = About(
        "allocate-then-score: attention-mass segments get quotas, the base picks inside",
        "AMS (Yang & Shen) Alg. 1, Sec. 3.2-3.3, App. B.2/B.4, Table 15; open settings: released code")
    # protect_prompt False: App. B.2 "cap the per-layer cache length at T_keep", prompt included;
    # only sinks and the recent suffix are always kept (and Sec. 3.3's must-keep set has no prompt)
    schedule: ClassVar[dict] = {"sinks": 4, "recent": 32, "interval": 512, "compress_prefill": False,
                                "prefill_block": 0, "protect_prompt": False, "recent_doc": "", "interval_doc": ""}

    def __post_init__(self, inner):
        if self.mass_window < 1 or self.mass_kernel < 1:
            raise ValueError(f"{self.prefix}: need mass_window >= 1 and mass_kernel >= 1")
        if not (0 <= self.ema_lambda < 1 and 0 <= self.ema_beta <= 1 and self.mass_epsilon > 0):
            raise ValueError(f"{self.prefix}: need 0 <= ema_lambda < 1, 0 <= ema_beta <= 1 and mass_epsilon > 0")
        check_choice(self.mass_reduction, HEAD_REDUCTIONS, f"{self.prefix} mass_reduction")
        check_choice(self.padding, ("missing", "suffix"), f"{self.prefix} padding")
        self.allocation = SegmentQuotas(self.delta, self.l_min, self.l_max, self.q_min, self.segmentation, self.order)
        # Every kv head keeps its own tokens (Sec. 3.1): a base that aligns heads is asked per kv head
        # (``score``).  Pooling, segments and quotas sort the slots by position, so the slot order
        # is free when the base's scores are; the keep-set is ``select``'s, never the scores' alone
        self.wrap(self.prefix, inner, example="expected",
                  meta={**inner.needs.meta, **({CREDIT: 0.0} if self.use_credit else {})},
                  # its own window attended a few rows at a time (``window_observations``)
                  query_window=max(self.mass_window, inner.needs.query_window),
                  attends_window=inner.needs.attends_window and inner.needs.query_window > 1,
                  slot_order_free=inner.needs.slot_order_free, selects=True,
                  aligned_heads=False, heads_combined_by="",
                  # the released code's batch-mean segments and batch-wide suffix maximum read every row
                  rows_coupled=inner.needs.rows_coupled or self.segmentation == "batch" or self.padding == "suffix",
                  # Alg. 1's order keeps the base's scores per layer index between score and select
                  stacks_layers=inner.needs.stacks_layers and self.order != "alg1")

    def score(self, layer, seen_tokens):
        """The base's scores g [B, H_kv, cap] (Alg. 1 line 32): the base sees only its own query
        window, and a base that aligns heads sees every kv head as its own row."""
        view, rows = layer.view().last_queries(self.inner.needs.query_window), 1
        if self.inner.needs.aligned_heads:
            view, rows = view.heads_as_rows(), layer.keys.shape[1]
        g = self.inner.score(view, seen_tokens.repeat_interleave(rows))
        g = g.reshape(layer.keys.shape[:3])
        if self.order == "alg1":  # Alg. 1 ranks must-keep tokens by g too; the engine masks them +inf
            self._raw[layer.layer_idx] = g
        return g

    def mass(self, layer) -> torch.Tensor:
        """Steps 1-2: the (history-aware) mass [B, H_kv, cap]; updates the credit in place."""
        window = layer.view().last_queries(self.mass_window)
        live = layer.live()
        mass = quality_mass(None, window.recent_query_pos, layer.meta["pos"], live, self.mass_kernel,
                            self.mass_epsilon, self.padding, self.mass_reduction, window_observations(window))
        if not self.use_credit:
            return mass
        layer.meta[CREDIT], mass = ema_credit(layer.meta[CREDIT], mass, live, self.ema_lambda, self.ema_beta)
        return mass

    def select(self, layer, scores, budget, seen_tokens):
        """Steps 1-2 here (the mass), steps 3-5 by ``self.allocation``: the keep mask of every
        (row, kv head)."""
        raw = self._raw.pop(layer.layer_idx, None)  # order="alg1": the base's own scores
        mask = self.allocation.keep_mask(self.mass(layer), scores, layer.meta["pos"], budget, raw)
        # a protected prompt makes budget a [B, 1] tensor of per-row counts (Policy.protect_prompt)
        return mask, min(layer.max_len, budget) if isinstance(budget, int) else None


@register_wrapper("ams-released")
@dataclass
class AMSReleased(AMS):
    """AMS with the released code's settings (README / ``evaluate_registry`` of the official
    repository): W 32, delta 0.02, L 32/1024, q_min 8, lambda 0.8, beta 0.7, suffix padding, one
    segmentation from the batch-mean mass, Algorithm 1's order; sinks 4, recent 32, kernel 5."""

    mass_window: int = 32
    delta: float = 0.02
    l_min: int = 32
    l_max: int = 1024
    q_min: int = 8
    ema_lambda: float = 0.8
    ema_beta: float = 0.7
    padding: str = "suffix"
    segmentation: str = "batch"
    order: str = "alg1"
    prefix: ClassVar[str] = "ams-released"
    about: ClassVar[About] = About(
        "AMS with the authors' released settings (preset)",
        "github.com/EIT-NLP/AdaptiveMassSegment README (window 32, delta .02, L 32/1024, q_min 8, ...)")
