"""CAOTE: evict the token whose removal changes the attention output least.

arXiv:2504.14051; official code: none published.

Based on "CAOTE: KV Caching through Attention Output Error based Token Eviction" (Sec. 3).
For one query with attention a over the b + 1 cached tokens and values v, evicting token j
and renormalising the rest changes the output o = sum_i a_i v_i by exactly
``c_j = a_j / (1 - a_j) * ||o - v_j||_2`` (Eq. 8, Thm. 3.2).  On top of any base method
(Eqs. 19-21) a is the base's retention scores normalised to sum to 1 (``h / sum h``, Eq. 21)
and o is built from them.  FastCAOTE (Eq. 22) replaces o by the mean of the cached values.

Heads (App. B.2, Case 2): the error of evicting a token from a kv head is the norm of the
concatenated changes of the G query heads that read it, so per-query-head errors are reduced
by root-sum-square.  The base is asked for per-query-head scores by scoring a view of the
layer in which every query head is its own kv head (a base whose state is per kv head, like
H2O's sums, gives G = 1).  A base that keeps heads aligned (TOVA's layer average) evicts one
token for the whole layer, so its error sums over every head.  Thm. 3.2's exactness needs the
true per-head attention: ``caote:tova`` with ``heads="group"``.

Schedule (Sec. 2 "During generation, the flow remains same with m=1"; Thm. 3.2; App. A):
Eq. (8) is the exact error of evicting *one* token after *one* new token, so while decoding
every wrapper here compresses every step (``interval`` 1, ``CAOTE.schedule``), whatever the
base's own interval (SnapKV's 64, R-KV's and SkipKV's 128); an explicit ``interval=`` still
wins.  Prefill is block-wise (Sec. 2 Eqs. 3-7, Sec. 4.1), ``prefill_block`` on by default; the
block m is the paper's 128 (Sec. 4.1, ``Defaults.prefill_block``), used by the engine for every
block-wise prefill whatever ``GenerateConfig.prefill_chunk`` says.  The m tokens evicted after
a block are scored independently (App. A: "even assuming multi-token eviction independently").
To compare with a base as the paper does (Tables 2-10), run the base under the same schedule:
``interval=1, prefill_block=True`` (its blocks are then 128 tokens too: the paper's bases also
read the prompt block-wise, Sec. 4.1 and Table 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache import kv_field, kv_sum
from ..policy import About
from . import register_wrapper
from ._common import PerQueryHeadScores
from ._wrapper import WrappingScorer


def retention_weights(scores: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Base scores [B, H_kv, G, S] made to sum to 1 over each head's live tokens (Eq. 21).

    Eq. (21) is h / sum h; Sec. 3.2 asks for an order-preserving affine map, so negative
    scores (knorm, keydiff) are first shifted by their minimum (kvsieve's choice).  Dead slots
    get weight 0.  live: [B, H_kv, S].
    """
    live_g = live[:, :, None]  # [B, H, 1, S]
    h = torch.where(live_g, scores.float(), 0.0)
    low = torch.where(live_g, h, float("inf")).amin(dim=-1, keepdim=True).clamp_(max=0.0)
    h.sub_(low).mul_(live_g)
    return h.div_(h.sum(dim=-1, keepdim=True).clamp_(min=torch.finfo(h.dtype).tiny))


def output_errors(h: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
                  value_sqnorm: torch.Tensor | None = None, out_dots: torch.Tensor | None = None) -> torch.Tensor:
    """c_j = h_j / (1 - h_j) * ||o - v_j|| for every token (Eq. 8, Eq. 20 on a base): [B, H_kv, G, S].

    h: [B, H_kv, G, S] weights summing to 1 (``retention_weights``); values: [B, H_kv, S, D];
    out: [B, H_kv, G, D] the output o; value_sqnorm: [B, H_kv, S] ||v_j||^2 and out_dots:
    [B, H_kv, G, S] o.v_j, each if already known.
    ||o - v_j||^2 = ||v_j||^2 - 2 o.v_j + ||o||^2 takes one matmul over V, never the
    [B, H, G, S, D] differences.  Eq. (8) is undefined at h_j = 1 (the rest has no weight to
    renormalise): such a token scores +inf, since evicting it would empty the output.
    """
    v = values.float()
    if value_sqnorm is None:
        value_sqnorm = v.square().sum(dim=-1)
    dots = torch.matmul(out, v.transpose(-1, -2)) if out_dots is None else out_dots
    sq = dots.mul(-2.0)  # [B, H, G, S]
    sq.add_(value_sqnorm[:, :, None]).add_(out.square().sum(dim=-1, keepdim=True))
    dist = sq.clamp_(min=0.0).sqrt_()
    ratio = h / (1.0 - h).clamp_(min=torch.finfo(h.dtype).tiny)
    return ratio.mul_(dist).masked_fill_(h >= 1, float("inf"))


def output_of(h: torch.Tensor, values: torch.Tensor, live: torch.Tensor, fast: bool,
              value_sum: torch.Tensor | None = None) -> torch.Tensor:
    """The output the errors are measured from, [B, H_kv, G, D]: o = h V (Eq. 20), or with
    ``fast`` the mean of the live values, [B, H_kv, 1, D] (Eq. 22), from ``value_sum`` [B, H_kv, D]
    (the cache's running sum) when given, else from a pass over V."""
    if not fast:
        return h @ values.float()
    if value_sum is None:
        value_sum = (live[..., None] * values.float()).sum(dim=2)
    count = live.sum(dim=-1, keepdim=True).clamp(min=1)  # [B, H, 1]
    return (value_sum.to(h.dtype) / count)[:, :, None]


def caote_errors(scores: torch.Tensor, values: torch.Tensor, live: torch.Tensor, fast: bool = False,
                 value_sqnorm: torch.Tensor | None = None, value_sum: torch.Tensor | None = None) -> torch.Tensor:
    """Eviction error of every token for every query head from base scores: [B, H_kv, G, S].

    scores: [B, H_kv, G, S] base retention scores per query head (normalised by
    ``retention_weights``); values: [B, H_kv, S, D]; live: [B, H_kv, S]; value_sqnorm as in
    ``output_errors``; fast and value_sum as in ``output_of``.
    """
    h = retention_weights(scores, live)
    return output_errors(h, values, output_of(h, values, live, fast, value_sum), value_sqnorm)


@register_wrapper("caote")
@dataclass
class CAOTE(WrappingScorer):
    """Attention-output error on top of a base scorer (``caote:<base>``).

    No own hyperparameters: the base's settings (reported under ``base`` in the policy's
    settings), the budget, sinks and recent window are set as for the base.

    Schedule defaults (``schedule``, replacing the base's ``Defaults``)
    ----------------------------------------
    interval : 1
        One eviction per generated token (Sec. 2 "m=1" during generation, Thm. 3.2), for every
        base; replaces the base's own default interval.
    prefill_block : True
        Compress after every prefill chunk (block-wise prefill, Sec. 2 Eqs. 3-7 and Sec. 4.1).
        Blocks of m = 128 tokens (``Defaults.prefill_block``, Sec. 4.1), in ``generate``, ``eval``
        and the CLI alike (``DecodeSession.prefill``).
    protect_prompt : False
        Prompt tokens compete for the budget (Sec. 4.1: they are evicted block-wise once the
        cache reaches it), for every base, as for the interval.
    """

    about: ClassVar[About] = About(
        "evict the token whose removal changes the attention output least (any base)",
        "CAOTE Sec. 3 (Eqs. 8, 20-21), App. B.2 heads; one eviction per decode step (Sec. 2, Thm. 3.2); "
        "block-wise prefill m=128 (Sec. 4.1)")
    fast: ClassVar[bool] = False
    # interval 1: Sec. 2 / Thm. 3.2; prefill_block 128: block m of Sec. 4.1; protect_prompt False: Sec. 4.1
    # "Prompt consumption": prompt tokens are evicted block-wise once the cache reaches the budget, so they
    # compete with generated tokens (whatever the base's default)
    schedule: ClassVar[dict] = {"interval": 1, "prefill_block": 128, "protect_prompt": False, "interval_doc": ""}

    def __post_init__(self, inner):
        # ||v_j||^2 kept per token; Eq. 22's mean value from a running sum (FastCAOTE).  Eq. 8 is per
        # token, so every other need (slot-order freedom included) is the base's.
        sums = (*inner.needs.kv_sums, "value_sum") if self.fast else inner.needs.kv_sums
        self.wrap("fastcaote" if self.fast else "caote", inner, example="tova",
                  kv_fields=tuple(dict.fromkeys((*inner.needs.kv_fields, "value_sqnorm"))),
                  kv_sums=tuple(dict.fromkeys(sums)), observes_steps=False, reads_values=True,  # its mix is one step's
                  heads_combined_by="")  # errors of every head from the base's combined weights: no one reduction

    def base_scores(self, layer, seen_tokens) -> torch.Tensor:
        """Base scores per query head, [B, H_kv, G', cap]: G' = 1 for a base that reads no
        queries, or whose per-query-head scores are all equal (TOVA's layer mean); G' = G
        otherwise.  A base offering ``PerQueryHeadScores`` (TOVA) gives them itself, without a
        copy of K/V per query head."""
        B, H = layer.lengths.shape
        group = self._group(layer)
        if group == 1:
            return self.inner.score(layer, seen_tokens)[:, :, None]
        if isinstance(self.inner, PerQueryHeadScores):  # its own per-query-head scores: no K/V copy per query head
            return self.inner.score_per_query_head(layer, seen_tokens)
        return self.inner.score(layer.view().repeat_heads(group), seen_tokens).reshape(B, H, group, -1)

    def _group(self, layer) -> int:
        """Query heads per kv head as the base sees them (1 for a base that reads no queries)."""
        queries = layer.recent_queries
        if self.inner.needs.query_window > 0 and queries is not None:
            return queries.shape[1] // layer.lengths.shape[1]
        return 1

    def observe(self, layer, probs, query_pos, steps=False):
        """The base's update, then (decode steps) the weights of the output the errors are
        measured from: h of Eq. (21) for CAOTE (o = h V, Eq. 20), uniform over the live tokens
        for FastCAOTE (the mean value, Eq. 22).  The attention pass returns o with its own
        output, and o.v_j while V is still in the CPU's cache (``layer.step_results``), so
        the compression after this step reads no V."""
        self.inner.observe(layer, probs, query_pos)
        if probs.shape[3] != 1 or query_pos is None:  # prefill chunks: o at compression
            return None
        live = layer.live()
        if self.fast:
            return live[:, :, None].float() / live.sum(dim=-1)[:, :, None, None].clamp(min=1)
        return retention_weights(self.base_scores(layer, query_pos[:, -1] + 1), live)

    def score(self, layer, seen_tokens):
        mix = layer.step_results.get("value_mix")  # (weights, o, o.v_j) from this step's attention pass
        if mix is not None and mix[0].shape[:2] != layer.lengths.shape:  # a wrapper's per-head view (ams:)
            mix = None
        if mix is not None and not self.fast:
            h, out, dots = mix
        else:
            live = layer.live()
            h = retention_weights(self.base_scores(layer, seen_tokens), live)
            if mix is not None:
                _, out, dots = mix
            else:  # FastCAOTE's mean from the cache's running sum
                value_sum = kv_sum(layer, "value_sum") if self.fast else None
                out, dots = output_of(h, layer.values, live, self.fast, value_sum), None
        errors = output_errors(h, layer.values, out, kv_field(layer, "value_sqnorm"), dots)  # [B, H, G', cap]
        copies = self._group(layer) // h.shape[2]  # query heads each of the G' rows stands for
        if errors.shape[2] == 1 and copies == 1 and not self.needs.aligned_heads:
            return errors[:, :, 0]
        squared = errors.square_().sum(dim=2)  # App. B.2: concatenated heads of each kv group
        if copies != 1:
            squared.mul_(copies)
        if self.needs.aligned_heads:  # one decision per layer: every head's change counts
            return squared.sum(dim=1, keepdim=True).sqrt_().expand_as(squared)
        return squared.sqrt_()  # [B, H_kv, cap]


@register_wrapper("fastcaote")
@dataclass
class FastCAOTE(CAOTE):
    """CAOTE with the output replaced by the mean of the cached values (Eq. 22), read from the
    cache's running sum of live values (``cache.KV_SUMS["value_sum"]``), so a step costs one pass
    over V (each token's distance to the mean), not two."""

    about: ClassVar[About] = About("CAOTE with the mean value in place of the output (FastCAOTE, any base)",
                                   "CAOTE Sec. 3.3, Eq. 22")
    fast: ClassVar[bool] = True
