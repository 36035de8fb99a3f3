"""Mass-segmented quotas: how AMS splits a budget over segments of the cache (Sec. 3.3, Alg. 1).

Based on Yang & Shen, "Adaptive Mass-Segmented KV Compression for Long-Form Reasoning" (AMS,
arXiv:2605.23200; code github.com/EIT-NLP/AdaptiveMassSegment).  Given a per-token mass over
the cache, for every (row, kv head), vectorised over both:

3. segments (Sec. 3.3, Alg. 1 lines 14-23): cut after ``b_k = min{t : c(t) >= k delta}``
   (searchsorted on the prefix sums), merge segments shorter than L_min, split longer than L_max.
4. quotas (Sec. 3.3, Alg. 1 lines 24-29): ``q_i = min(q_min, L_i) + round(T_rem M_i / sum M)``,
   adjusted so that ``sum q_i`` is exactly the budget and ``q_i <= L_i``.
5. must-keep sinks and recent suffix (the policy's protected tokens), top-q_i of each segment by
   the base score, trim or backfill to exactly T_keep (Alg. 1 lines 30-41).

``SegmentQuotas`` runs the three steps; the functions below are its parts.  It is an allocator in
DESIGN.md's sense (how many tokens each segment keeps) but is not registered in ``ALLOCATORS``: an
``--allocator`` gets only the policy's scores, and the segments need a mass over the cache (AMS's
window attention, Sec. 3.2) that an arbitrary scorer does not give, so ``ams:<base>`` builds one from
its own settings and hands it the mass of steps 1-2 (``kvsieve.methods.ams``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache import DEAD_POS
from ..checks import check_fields
from ..policy import check_choice


def normalize(x: torch.Tensor) -> torch.Tensor:
    """``x`` over its sum along the last dimension (a zero sum stays zero)."""
    return x / x.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)


# ---------------------------------------------------------------------------- Step 3: segments
def _segment_bounds(starts: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and end (exclusive) of the segment of every token: [..., T] each."""
    t = torch.arange(starts.shape[-1], device=starts.device)
    start = torch.where(starts, t, 0).cummax(dim=-1).values
    nxt = torch.where(starts, t, n[..., None]).flip(-1).cummin(dim=-1).values.flip(-1)  # first start >= t
    end = torch.cat([nxt[..., 1:], n[..., None]], dim=-1).minimum(n[..., None])
    return start, end


def split_long(starts: torch.Tensor, n: torch.Tensor, l_max: int) -> torch.Tensor:
    """Split every segment longer than ``l_max`` into ceil(L / l_max) parts of near-equal length."""
    t = torch.arange(starts.shape[-1], device=starts.device)
    start, end = _segment_bounds(starts, n)
    length, r = (end - start).clamp(min=1), t - start
    parts = (length + l_max - 1) // l_max
    cut = (r > 0) & ((r * parts) // length != ((r - 1) * parts) // length)
    return (starts | cut) & (t < n[..., None])


def merge_short(starts: torch.Tensor, n: torch.Tensor, l_min: int) -> torch.Tensor:
    """Merge segments shorter than ``l_min``: scanning left to right, a segment absorbs the
    following ones until it is >= l_min long (released code), and a short last one joins its
    left neighbour.  The scan is pointer doubling over "next cut >= start + l_min" (log2 T steps)."""
    T = starts.shape[-1]
    nodes = torch.arange(T + 1, device=starts.device)  # token positions plus an end node
    cuts = torch.cat([starts, torch.zeros_like(starts[..., :1])], dim=-1).scatter_(-1, n[..., None], True)
    nxt = torch.where(cuts, nodes, T).flip(-1).cummin(dim=-1).values.flip(-1)  # first cut >= p
    jump = nxt.gather(-1, (nodes + l_min).minimum(n[..., None]))  # next kept start after p
    reach = torch.zeros_like(cuts)
    reach[..., 0] = True
    for _ in range(max(1, math.ceil(math.log2(T + 1)))):  # bounded: log2 of the cache length
        hit = torch.zeros_like(jump).scatter_add_(-1, jump, reach.long()) > 0
        reach, jump = reach | hit, jump.gather(-1, jump)
    kept = reach[..., :T] & (nodes[:T] < n[..., None])
    last = torch.where(kept, nodes[:T], 0).amax(dim=-1, keepdim=True)  # start of the last segment
    short_tail = (n[..., None] - last < l_min) & (last > 0)
    return kept & ~((nodes[:T] == last) & short_tail)


def segment_starts(mass: torch.Tensor, n: torch.Tensor, delta: float, l_min: int, l_max: int) -> torch.Tensor:
    """[..., T] bool, True at the first token of each segment of the first ``n`` tokens."""
    T = mass.shape[-1]
    t = torch.arange(T, device=mass.device)
    k = torch.arange(1, math.ceil(1 / delta), device=mass.device, dtype=torch.float64)
    thresholds = (k * delta)[k * delta < 1].to(mass.dtype)
    cum = mass.cumsum(dim=-1).contiguous()
    starts = (t == 0) & (n[..., None] > 0)
    if thresholds.numel():
        b = torch.searchsorted(cum, thresholds.expand(*cum.shape[:-1], -1).contiguous()) + 1  # b_k
        # column T collects the cuts at or past the end; for the others every duplicate of b agrees
        cut = torch.zeros_like(cum, dtype=torch.bool)[..., :1].expand(*cum.shape[:-1], T + 1).clone()
        starts = starts | cut.scatter_(-1, b.clamp(max=T), b < n[..., None])[..., :T]
    # deviation: Alg. 1 checks each raw segment for a split (> L_max) or a merge (< L_min); merging
    # first and splitting last makes both bounds hold afterwards (when L_max >= 2 L_min)
    return split_long(merge_short(starts, n, l_min), n, l_max)


def segment_ids(starts: torch.Tensor) -> torch.Tensor:
    """Segment index of every token (tokens past the end belong to the last segment)."""
    return (starts.long().cumsum(dim=-1) - 1).clamp(min=0)


# ---------------------------------------------------------------------------- Step 4: quotas
def _fill_in_order(amount, room, order):
    """Give up to ``amount`` [..., 1] units to slots with ``room`` [..., S], in ``order``."""
    room_sorted = room.gather(-1, order)
    before = room_sorted.cumsum(dim=-1) - room_sorted
    give = torch.minimum(room_sorted, (amount - before).clamp(min=0))
    return torch.zeros_like(room).scatter_(-1, order, give)


def allocate_quotas(seg_mass, capacity, total, q_min: int) -> torch.Tensor:
    """Quotas [..., S] with sum min(total, sum capacity) and q_i <= capacity_i (Sec. 3.3).

    seg_mass, capacity: [..., S] (capacity 0 for unused segment slots); total: [...] tokens to
    hand out.  ``q_i = min(q_min, L_i) + round(T_rem M_i / sum M)`` with the rounding done by
    largest remainders; what a full segment cannot take goes to the others in decreasing mass.
    If ``total`` cannot give every segment its minimum, the heaviest segments get it first.
    """
    total = total[..., None]
    by_mass = seg_mass.argsort(dim=-1, descending=True, stable=True)
    base = _fill_in_order(total, capacity.clamp(max=q_min), by_mass)  # q_i^min
    rest = total - base.sum(dim=-1, keepdim=True)  # T_rem
    seg_mass = seg_mass.double()
    share = rest * seg_mass / seg_mass.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(seg_mass.dtype).tiny)
    # deviation: Sec. 3.3's round() then "adjust": rounding by largest remainders sums exactly
    floor = share.floor()
    by_remainder = (share - floor).argsort(dim=-1, descending=True, stable=True)
    left = rest - floor.sum(dim=-1, keepdim=True).long()
    bonus = torch.zeros_like(capacity).scatter_(-1, by_remainder, (torch.arange(
        capacity.shape[-1], device=capacity.device) < left).long())
    quota = torch.minimum(base + floor.long() + bonus, capacity)  # clip q_i <= L_i
    missing = total - quota.sum(dim=-1, keepdim=True)  # adjustment step: sum q_i = total
    quota = quota + _fill_in_order(missing, capacity - quota, by_mass)
    excess = (-missing).clamp(min=0)  # float rounding only: take back from the lightest segments
    return quota - _fill_in_order(excess, quota - base.minimum(quota), by_mass.flip(-1))


# ---------------------------------------------------------------------------- Step 5: selection
def _order_by(*keys: torch.Tensor) -> torch.Tensor:
    """Permutation sorting by ``keys`` ascending, the first key most significant (stable)."""
    perm = None
    for key in reversed(keys):
        k = key if perm is None else key.gather(-1, perm)
        step = k.argsort(dim=-1, stable=True)
        perm = step if perm is None else perm.gather(-1, step)
    return perm


def top_per_segment(seg, score, selectable, quota) -> torch.Tensor:
    """[..., T] bool: the ``quota[seg]`` highest-scoring selectable tokens of every segment
    (Alg. 1 lines 34-36); ties keep the earlier token."""
    perm = _order_by(seg, (~selectable).long(), -score.nan_to_num(float("-inf")))
    seg_sorted = seg.gather(-1, perm)
    count = torch.zeros_like(seg).scatter_add_(-1, seg, torch.ones_like(seg))
    first = count.cumsum(dim=-1) - count  # where each segment begins in sorted order
    rank = torch.arange(seg.shape[-1], device=seg.device) - first.gather(-1, seg_sorted)
    chosen = (rank < quota.gather(-1, seg_sorted)) & selectable.gather(-1, perm)
    return torch.zeros_like(selectable).scatter_(-1, perm, chosen)


def fill_to_budget(chosen, must, sink, score, valid, keep) -> torch.Tensor:
    """Exactly ``min(keep, valid count)`` tokens [..., T] (Alg. 1 lines 38-41, Sec. 3.3): sinks
    first, then the recent suffix newest first (it shrinks from its old end if the budget is
    short), then the segment picks by score (the lowest are trimmed), then the best of the
    rest (backfill)."""
    rank = torch.arange(chosen.shape[-1], device=chosen.device).expand_as(chosen)
    tier = torch.where(sink, 4, torch.where(must, 3, torch.where(chosen, 2, 1))) * valid
    within = torch.where(sink, -rank.float(), torch.where(must, rank.float(), score.float()))
    perm = _order_by(-tier, -within.nan_to_num(float("-inf")))
    kept = (torch.arange(chosen.shape[-1], device=chosen.device) < keep[..., None]) & (tier.gather(-1, perm) > 0)
    return torch.zeros_like(chosen).scatter_(-1, perm, kept)


# ---------------------------------------------------------------------------- the allocator
@dataclass(frozen=True)
class SegmentQuotas:
    """Steps 3-5 for every (row, kv head): segments of the mass, quotas, and the kept tokens.

    Settings as ``AMS`` documents them, with their Table 15 defaults there: ``delta`` the target
    segment mass, ``l_min``/``l_max`` the segment length bounds, ``q_min`` the minimum quota,
    ``segmentation`` "row" (per row and kv head, Alg. 1) or "batch" (one segmentation per kv head
    from the batch-mean mass, released code), ``order`` "sec3.3" or "alg1" (below).

    Order of must-keep and quotas (``order``): "sec3.3" follows Sec. 3.3's "must-keep positions are
    inserted first and the remaining budget is allocated to segments; if the remaining budget
    becomes negative, we reduce the recent-token suffix while always preserving sink tokens":
    quotas split ``T_keep - |must|`` over the non-must tokens, so the union is exactly T_keep.
    "alg1" follows Algorithm 1 (and the released code): quotas split T_keep over every token, the
    must-keep set is added, and the lowest-scoring non-must tokens are trimmed (or the best
    remaining backfilled).
    """

    delta: float
    l_min: int
    l_max: int
    q_min: int
    segmentation: str
    order: str
    SEGMENTATIONS: ClassVar[tuple[str, ...]] = ("row", "batch")
    ORDERS: ClassVar[tuple[str, ...]] = ("sec3.3", "alg1")

    def __post_init__(self):
        check_fields(self)
        if not (0 < self.delta <= 1 and self.q_min >= 0 and 1 <= self.l_min <= self.l_max):
            raise ValueError(f"mass segments need 0 < delta <= 1, q_min >= 0 and 1 <= l_min <= l_max; got "
                             f"delta={self.delta}, q_min={self.q_min}, l_min={self.l_min}, l_max={self.l_max}")
        check_choice(self.segmentation, self.SEGMENTATIONS, "mass segments segmentation")
        check_choice(self.order, self.ORDERS, "mass segments order")

    def keep_mask(self, mass: torch.Tensor, scores: torch.Tensor, pos: torch.Tensor, budget,
                  raw: torch.Tensor | None = None) -> torch.Tensor:
        """Keep mask [B, H, cap] of exactly min(T_keep, live count) tokens per (row, kv head),
        read in position order whatever order the slots hold them in.

        mass [B, H, cap]: the per-token mass (steps 1-2); scores [B, H, cap]: the policy's scores
        (+inf on the must-keep sinks and recent suffix, -inf on dead slots); pos [B, H, cap]: each
        slot's position, DEAD_POS on dead slots; budget: T_keep, an int or per-row counts [B, 1]
        (a protected prompt, ``Policy.protect_prompt``); raw [B, H, cap]: the base's own scores g,
        by which ``order="alg1"`` ranks the must-keep tokens too (Alg. 1 line 32; default ``scores``).
        """
        slots = pos.argsort(dim=-1, stable=True)  # [B, H, cap] slots by position, dead slots (DEAD_POS) last
        n = (pos != DEAD_POS).sum(dim=-1)  # [B, H] live tokens
        valid = torch.arange(pos.shape[-1], device=pos.device) < n[..., None]
        mass = mass.gather(-1, slots) * valid
        must = (scores == float("inf")).gather(-1, slots) & valid  # the policy's sinks + recent
        sink = must.long().cumprod(dim=-1).bool()  # the must-keep run from position 0
        score = (scores if self.order == "sec3.3" or raw is None else raw).gather(-1, slots)
        keep = n.clamp(max=budget)  # T_keep per (row, kv head)
        seg_mass, seg_n = mass, n
        if self.segmentation == "batch":  # released code: one segmentation from the batch-mean mass
            seg_mass, seg_n = normalize(mass.sum(dim=0, keepdim=True)), n.amax(dim=0, keepdim=True)
        starts = segment_starts(seg_mass, seg_n, self.delta, self.l_min, self.l_max)
        seg = segment_ids(starts).expand_as(mass).contiguous()  # [B, H, cap] segment of each token
        # deviation: Alg. 1 (quotas, then must-keep, then trim) and Sec. 3.3 (must-keep first) differ;
        # Sec. 3.3's order is the default, Alg. 1's is order="alg1"
        if self.order == "sec3.3":  # must-keep first, quotas share what is left
            selectable, total = valid & ~must, (keep - must.sum(dim=-1)).clamp(min=0)
        else:
            selectable, total = valid, keep
        capacity = torch.zeros_like(seg).scatter_add_(-1, seg, selectable.long())
        seg_total = torch.zeros_like(mass).scatter_add_(-1, seg, seg_mass.expand_as(mass) * valid)
        quota = allocate_quotas(seg_total, capacity, total, self.q_min)
        chosen = top_per_segment(seg, score, selectable, quota)
        kept = fill_to_budget(chosen, must, sink, score, valid, keep)
        return torch.zeros_like(slots).scatter_add_(-1, slots, kept.long()) > 0
