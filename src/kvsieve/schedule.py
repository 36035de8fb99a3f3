"""The schedule: the one owner of eviction (what goes, when, in place or by gather).

A policy (``kvsieve.policy.Policy``) is settings; a ``Schedule`` acts on them for one store
(``kvsieve.engine.Store``: ``SieveCache`` in transformers).  After every forward pass its driver
makes one call: ``DecodeSession`` (kvsieve's loop) after each prefill block, at the end of the
prompt and after each decode step; ``kvsieve.hf.ScheduledCache`` (transformers' ``generate``) per
layer, before the layer is read again.  Each call goes the same way, for every layer due::

    scorer.score(layer view)  ->  scores [B, H_kv, capacity]           the method's math
    protected_scores          ->  sinks, recent window, prompt +inf; dead slots -inf
    select / allocator        ->  a keep-set per (row, kv head)         gather or in place
    layer.compact / evict     ->  the store applies it                  the engine adapter

What a method needs from the store (fields, sums, query window) and each layer's capacity plan
are computed here from the policy and passed to the store as plain values (``store_settings``):
the store is never handed the policy.

Cross-layer selection (``Needs.cross_layer``, TriAttention's ``per_head``: kv head h keeps the
same tokens in every layer, chosen by the mean over layers of each layer's scores) is
``Schedule.compress``'s other path: it scores every layer first, averages, then applies the
same keep-set to each (``compress_across_layers``).

The prompt is handled in one of three ways (``Policy``): it competes with the generated tokens;
it is protected outside the budget (``protect_prompt``: ``prompt_len`` below, each row keeps
``prompt_len + budget``); or it is pinned inside it (``pin_prompt``: ``pinned`` below, each row's
first ``min(prompt_len, budget)`` positions score +inf and the row keeps ``budget`` in all).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from .cache import DEAD_POS
from .engine import Store, StoreLayer
from .policy import Policy, Scorer


# ---------------------------------------------------------------------------- keep-sets
def indices_from_mask(keep: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a keep mask [B, H, S] into ``kept_idx`` [B, H, K] (kept slots first, in slot
    order, then zeros) and ``new_lengths`` [B, H]."""
    S = keep.shape[-1]
    slot = torch.arange(S, device=keep.device).expand_as(keep)
    order = torch.where(keep, slot, S).sort(dim=-1).values[..., :K]
    return order.masked_fill(order == S, 0), keep.sum(dim=-1)


def ranked(scores: torch.Tensor, pos: torch.Tensor, k: int, largest: bool = True) -> torch.Tensor:
    """The ``k`` slots [B, H, k] of the highest (``largest``) or lowest ``scores`` [B, H, S], best
    first, under one total order: equal scores rank by position, the newer token above the older.

    Keeping the top ``k`` and evicting the bottom ``S - k`` then pick complementary sets, so an
    engine that evicts in place (kvsieve's, at steady capacity) and one that gathers the kept
    tokens (vLLM's paged one) keep the same tokens even where scores tie, as the integer
    timestamps of LazyEviction and RaaS do by the dozen; ``topk`` alone leaves ties to the kernel.
    No paper fixes a tie rule; preferring the newer token is StreamingLLM's recency bias.
    -0.0 ties with 0.0; positions are below 2**31 (``DEAD_POS`` included).  NaN has no place in
    the order (scores never hold one: dead slots are -inf or +inf).

    Two ways to one answer, chosen by ``k`` alone (a Python int, so a compiled step traces one
    graph): ``k == 1``, the one-token eviction in place of every decode step, is ``_best``, a min or
    max and one arg-reduction (four kernels); any other ``k`` is one ``topk`` over ``rank_key``.
    Building the key is what costs, not the int64 ``topk``: at the engine's step shape every
    element-wise kernel is a few microseconds of dispatch whatever its size, and over wide rows a
    ``where`` on mixed signs is the slowest pass.  End to end the rule costs no measurable step
    time (docs/benchmarks.md, "The tie rule's cost"); ``tests/test_tie_rule.py`` checks its order."""
    if k == 1:
        return _best(scores, pos, largest)
    return rank_key(scores, pos).topk(k, dim=-1, largest=largest).indices


def rank_key(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[B, H, S] int64 keys whose integer order is ``ranked``'s: (score, position) in lexicographic
    order.  The high 32 bits are the float32 score's bits (-0.0 made 0.0 first), its negative
    values' magnitude bits flipped so that the integers order as the floats do; the position fills
    the low 32 bits.  The flip is shift, mask and xor, not a ``where`` on the sign: on this CPU
    ``where`` over a mask of mixed signs is a branchy loop, about 20x the three passes over 65k
    scores; and shift-and-or is one ``add`` of the high part scaled by 2**32."""
    bits = (scores.float() + 0.0).view(torch.int32)  # [B, H, S]
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives (sign 1) get their magnitude bits flipped
    return pos.add(ordered, alpha=1 << 32)  # int64: ordered * 2**32 + pos


def _best(scores: torch.Tensor, pos: torch.Tensor, largest: bool) -> torch.Tensor:
    """``ranked``'s first slot [B, H, 1] without its key: the best score (a max or min, which sees
    -0.0 and 0.0 as equal, as the rule does), then among the slots holding it the newest
    (``largest``) or the oldest position, every other slot pushed 2**32 out of the way (positions
    are below 2**31) by adding its mask (strictly worse than the best: ``>`` is cheaper than ``!=``
    here).  Four kernels against the key's six; at the engine's step shape, 2x faster."""
    if largest:
        best = scores.amax(dim=-1, keepdim=True)
        return pos.add(scores < best, alpha=-(1 << 32)).argmax(dim=-1, keepdim=True)
    best = scores.amin(dim=-1, keepdim=True)
    return pos.add(scores > best, alpha=1 << 32).argmin(dim=-1, keepdim=True)


def top_k_indices(scores: torch.Tensor, pos: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as ``indices_from_mask`` on a top-``k`` mask (``ranked``), without building the
    mask: ``kept_idx`` [B, H, k] in slot order (slots scored -inf, i.e. dead, moved to the end and
    zeroed) and ``new_lengths`` [B, H]."""
    S = scores.shape[-1]
    idx = ranked(scores, pos, k)
    dead = scores.gather(-1, idx) == float("-inf")
    kept = idx.masked_fill(dead, S).sort(dim=-1).values
    return kept.masked_fill_(kept == S, 0), k - dead.sum(dim=-1)


def protected_mask(pos: torch.Tensor, seen_tokens: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """[B, H, S] bool: live slots in the first ``sinks`` or last ``recent`` positions of each row."""
    is_recent = (pos >= (seen_tokens - recent)[:, None, None]) & (pos != DEAD_POS)
    return is_recent | (pos < sinks) if sinks > 0 else is_recent


def prompt_mask(pos: torch.Tensor, prompt_len: torch.Tensor) -> torch.Tensor:
    """[B, H, S] bool: live slots holding one of their row's prompt tokens (position below the
    row's prompt length ``prompt_len`` [B]; dead slots never are, DEAD_POS being above any)."""
    return pos < prompt_len[:, None, None]


def row_budget(budget: int, prompt_len: torch.Tensor | None):
    """The tokens each (row, head) may keep: ``budget``, or with a protected prompt ``prompt_len``
    [B] + ``budget`` as a [B, 1] tensor (broadcasting against [B, H_kv] lengths)."""
    return budget if prompt_len is None else (prompt_len + budget)[:, None]


def protected_scores(layer: StoreLayer, policy: Policy, seen_tokens: torch.Tensor,
                     prompt_len: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H_kv, capacity] float scores of one layer with the schedule applied: sinks, the
    recent window and every position below ``prompt_len`` [B] (a protected prompt, or the pinned
    part of a pinned one) at +inf, dead slots at -inf (a copy: never the scorer's own state)."""
    return protect(policy.scorer.score(layer, seen_tokens).float(), layer.meta["pos"], policy, seen_tokens, prompt_len)


def protect(scores: torch.Tensor, pos: torch.Tensor, policy: Policy, seen_tokens: torch.Tensor,
            prompt_len: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` [B, H_kv, capacity] of slots at positions ``pos`` with the schedule applied, as
    ``protected_scores`` says (a copy)."""
    keep = protected_mask(pos, seen_tokens, policy.sinks, policy.recent) if policy.sinks or policy.recent else None
    if prompt_len is not None:
        keep = prompt_mask(pos, prompt_len) if keep is None else keep | prompt_mask(pos, prompt_len)
    if keep is not None:
        scores = scores.masked_fill(keep, float("inf"))
    else:
        scores = scores.clone()  # never write into a scorer's own state (H2O returns its sums)
    return scores.masked_fill_(pos == DEAD_POS, float("-inf"))


def cross_layer_scores(layers, policy: Policy, seen_tokens: torch.Tensor,
                       prompt_len: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H_kv, capacity] the mean over ``layers`` of the scorer's scores, protected as
    ``protected_scores`` says (``Needs.cross_layer``: every layer holds the same positions in the
    same slots, so the first layer's positions stand for all)."""
    mean = torch.stack([policy.scorer.score(layer, seen_tokens).float() for layer in layers]).mean(dim=0)
    return protect(mean, layers[0].meta["pos"], policy, seen_tokens, prompt_len)


def evict_in_place(layer: StoreLayer, policy: Policy, budget: int, seen_tokens: torch.Tensor, excess: int,
                   scores: torch.Tensor | None = None, prompt_len: torch.Tensor | None = None,
                   max_len: int | None = None, pinned: torch.Tensor | None = None) -> None:
    """Drop the ``excess`` lowest-scored tokens of every head over ``budget`` (in place, see
    ``engine``): device work only, so a compiled decode step can contain it; ``max_len`` is the
    layer's new host-side bound (None inside a compiled step: ``Schedule.after_step`` sets it).
    ``scores``: ``protected_scores`` when already computed (a scorer is asked once per
    compression: ``random`` draws new scores on every call).  ``prompt_len`` [B]
    (``protect_prompt``): each row keeps its prompt and ``budget`` more; ``pinned`` [B]
    (``pin_prompt``, when ``scores`` is None): each row keeps its first ``pinned`` positions."""
    if scores is None:
        scores = protected_scores(layer, policy, seen_tokens, prompt_len if pinned is None else pinned)
    pos = layer.meta["pos"]
    lowest = ranked(scores.masked_fill_(pos == DEAD_POS, float("inf")), pos, excess, largest=False)
    layer.evict(lowest, (layer.lengths - row_budget(budget, prompt_len)).clamp(min=0, max=excess), max_len)


def drop_dead_layer(layer: StoreLayer, headroom: int, past_hint: bool = False) -> None:
    """Remove a layer's padding slots (after prefill) with one gather, leaving ``headroom`` free
    slots, at most up to the capacity hint unless ``past_hint``: a bounded policy that leaves the
    prompt uncompressed until its next compression (LazyEviction, AMS, SkipKV) needs its interval
    of appends beyond budget + interval when the prompt is longer than the budget; capping it at
    the hint would grow the store by a whole chunk.  One host read of the longest row."""
    keep = layer.live()
    K = int(keep.sum(dim=-1).max())
    kept_idx, new_lengths = indices_from_mask(keep, K)
    capacity = K + headroom
    if layer.capacity_hint is not None and not past_hint:
        capacity = max(K, min(capacity, layer.capacity_hint))
    layer.compact(kept_idx, new_lengths, capacity=capacity, max_len=K)


def compress_layer(layer: StoreLayer, policy: Policy, budget: int | None, seen_tokens: torch.Tensor,
                   prompt_len: torch.Tensor | None = None, prompt_max: int = 0,
                   pinned: torch.Tensor | None = None) -> None:
    """Evict down to ``budget`` tokens per (row, kv head) in one layer (no-op if it fits): score
    it (``protected_scores``), then ``keep_layer``.

    With ``prompt_len`` [B] (``Policy.protect_prompt``) row r keeps its whole prompt and at most
    ``budget`` other tokens, ``prompt_len[r] + budget`` in all; ``prompt_max`` is a host-side
    upper bound on ``prompt_len`` (``SieveCache.prompt_max``), so no step reads the device for it.
    With ``pinned`` [B] (``Policy.pin_prompt``) row r keeps its first ``pinned[r]`` positions
    inside its ``budget``."""
    bound = budget if budget is None or prompt_len is None else budget + prompt_max
    if not policy.scorer.should_compress(layer, bound):
        return
    scores = protected_scores(layer, policy, seen_tokens, prompt_len if pinned is None else pinned)
    keep_layer(layer, policy, budget, seen_tokens, scores, prompt_len, bound)


def keep_layer(layer: StoreLayer, policy: Policy, budget: int | None, seen_tokens: torch.Tensor,
               scores: torch.Tensor, prompt_len: torch.Tensor | None, bound: int | None) -> None:
    """Turn one layer's ``scores`` [B, H_kv, capacity] (``protected_scores``) into a keep-set per
    (row, kv head) and have the layer apply it (``engine``): in place when the scorer allows any
    slot order and the layer is at its steady capacity, else by one gather of the slots the
    scorer's own ``select`` or the allocator keeps.  ``bound``: the layer's bound (the budget,
    + ``prompt_max`` with a protected prompt)."""
    dead = layer.meta["pos"] == DEAD_POS
    chosen = policy.scorer.select(layer, scores, budget if budget is None else row_budget(budget, prompt_len),
                                  seen_tokens)
    if chosen is None and can_evict_in_place(layer, policy, bound):
        evict_in_place(layer, policy, budget, seen_tokens, excess=layer.max_len - bound, scores=scores,
                       prompt_len=prompt_len, max_len=bound)
        return
    if chosen is None and not policy.allocator.ragged_heads and prompt_len is None:
        kept_idx, new_lengths = top_k_indices(scores, layer.meta["pos"], min(layer.max_len, budget))
    else:
        if chosen is None and prompt_len is None:
            chosen = policy.allocator.select(scores, budget, min(layer.max_len, budget))
        elif chosen is None:  # the allocator splits the budget over the generated tokens; the prompt stays
            prompt = prompt_mask(layer.meta["pos"], prompt_len)
            keep, K = policy.allocator.select(scores.masked_fill(prompt, float("-inf")), budget,
                                              min(layer.max_len, budget))
            chosen = keep | prompt, None if K is None else min(layer.max_len, bound)
        keep, K = chosen
        keep = keep & ~dead
        if K is None:  # ragged per-head counts: one host read per compression
            K = int(keep.sum(dim=-1).max())
        kept_idx, new_lengths = indices_from_mask(keep, K)
    layer.compact(kept_idx, new_lengths, capacity=kept_idx.shape[-1] + policy.interval, max_len=kept_idx.shape[-1])


def keep_set(layer, policy: Policy, budget: int, seen_tokens: torch.Tensor,
             prompt_len: torch.Tensor | None = None, pinned: torch.Tensor | None = None,
             scores: torch.Tensor | None = None) -> torch.Tensor:
    """The slots each (row, kv head) of ``layer`` keeps when every head must keep the same count:
    ``kept_idx`` [B, H_kv, K] in slot order, K = ``budget`` (+ each row's ``prompt_len`` [B] with a
    protected prompt, one value for every row).  For a store whose heads share one block table (a
    paged engine: AMS Appendix E), with the uniform allocator; the choice is ``keep_layer``'s: the
    layer's ``protected_scores``, then the scorer's own ``select`` or the top K.  It is read only:
    the caller moves the slots.  A ``select`` that keeps another count in some head is refused.
    ``pinned`` [B] (``pin_prompt``): each row's first positions kept inside ``budget``; ``scores``:
    the protected scores when already made (``cross_layer_scores``)."""
    if scores is None:
        scores = protected_scores(layer, policy, seen_tokens, prompt_len if pinned is None else pinned)  # [B, H, S]
    keep = budget if prompt_len is None else budget + int(prompt_len.max())
    if prompt_len is not None and int(prompt_len.min()) + budget != keep:
        raise ValueError("keep_set: rows with different prompt lengths keep different counts")
    chosen = policy.scorer.select(layer, scores, row_budget(budget, prompt_len), seen_tokens)
    if chosen is None:
        kept_idx, new_lengths = top_k_indices(scores, layer.meta["pos"], keep)
    else:
        kept_idx, new_lengths = indices_from_mask(chosen[0] & (layer.meta["pos"] != DEAD_POS), keep)
    if bool((new_lengths != keep).any()):
        raise ValueError(f"{policy.name} kept {new_lengths.tolist()} tokens per head, not {keep} in each")
    return kept_idx


def can_evict_in_place(layer: StoreLayer, policy: Policy, bound: int) -> bool:
    """In place when the scorer allows any slot order, the allocator keeps the same count in
    every head, and the layer is already at its steady capacity (bound + interval), so that
    nothing would be returned by reallocating (right after prefill it would).  ``bound``: the
    layer's bound (with a protected prompt, budget + ``SieveCache.prompt_max``)."""
    return (policy.scorer.needs.slot_order_free and not policy.allocator.ragged_heads
            and layer.capacity <= bound + policy.interval and layer.max_len - bound <= policy.interval)


# ---------------------------------------------------------------------------- plans: plain numbers
def layer_budgets(policy: Policy, num_layers: int) -> list[int | None]:
    """Each layer's budget (None: a layer kept whole), split by the policy's allocator."""
    if policy.scorer is None or policy.budget is None:
        return [None] * num_layers
    budgets = policy.allocator.layer_budgets(policy.budget, num_layers, policy.sinks + policy.recent)
    return [b if i >= policy.scorer.needs.whole_layers else None for i, b in enumerate(budgets)]


@dataclass(frozen=True)
class Feed:
    """How ``DecodeSession`` hands a batch's tokens to the store between compression checks: what
    a self-sizing scorer's peak (``Scorer.sized``) is bounded over.

    ``prompt``: the batch's longest prompt in real tokens (0: not known, ``kvsieve.hf``);
    ``block``: ``Policy.prefill_block_size()``, the prompt arrives in blocks of this many tokens,
    each followed by a check (None: whole, checked once after prefill, or without
    ``compress_prefill`` first at decode step ``interval``); ``interval``, ``compress_prefill``: the ``Policy``'s.
    """

    prompt: int = 0
    block: int | None = None
    interval: int = 1
    compress_prefill: bool = True

    @property
    def held(self) -> int:
        """Tokens the longest row holds at its first check when its prompt arrives whole: the
        prompt, and ``interval`` decode tokens more without ``compress_prefill`` (0 with blocks)."""
        if self.block is not None:
            return 0
        return self.prompt + (0 if self.compress_prefill else self.interval)


def feed(policy: Policy, prompt: int = 0) -> Feed:
    """The policy's schedule as the store sees it, for a batch whose longest prompt is ``prompt``."""
    return Feed(prompt=prompt, block=policy.prefill_block_size(), interval=policy.interval,
                compress_prefill=policy.compress_prefill)


def unbudgeted_peaks(policy: Policy, num_layers: int, horizon: int, prompt: int = 0) -> list[int]:
    """Per layer, the most tokens a row of at most ``horizon`` tokens holds per kv head when
    the layer has no budget, the prompt's wait for its first check apart: the scorer's own
    bound (``Scorer.sized``) on the layers it compresses, the horizon elsewhere."""
    own = None if policy.scorer is None else policy.scorer.sized(horizon, feed(policy, prompt))[1]
    whole = 0 if policy.scorer is None else policy.scorer.needs.whole_layers
    return [horizon if own is None or i < whole else min(horizon, own) for i in range(num_layers)]


def fitted(policy: Policy, horizon: int, prompt: int = 0) -> Policy:
    """The policy to run for rows of at most ``horizon`` tokens whose longest prompt is
    ``prompt`` (0: not known): a self-sizing scorer given a budget (``Needs.fits_budget``) gets
    settings fitted to it and this schedule; every other policy is returned as is."""
    if policy.scorer is None or policy.scorer.needs.uses_budget or policy.budget is None:
        return policy
    scorer, _ = policy.scorer.sized(horizon, feed(policy, prompt), int(policy.budget))
    return dataclasses.replace(policy, scorer=scorer)


def scorer_fields(scorer: Scorer | None) -> dict:
    """What a store keeps for ``scorer`` (None: ``full``), as ``SieveCache``'s keyword arguments:
    per-token fields with their initial values, K/V statistics, running sums, query window."""
    if scorer is None:
        return {}
    needs = scorer.needs
    return {"meta_init": needs.meta, "kv_fields": needs.kv_fields, "kv_sums": needs.kv_sums,
            "query_window": needs.query_window}


def store_settings(policy: Policy, num_layers: int, horizon: int) -> dict:
    """A decode store's settings for ``policy`` (``SieveCache(num_layers, **settings)``): the
    scorer's fields and each layer's capacity hint: never allocate past what a row of ``horizon``
    tokens can need, budget + interval for a bounded layer, the scorer's own peak for one
    without a budget (``unbudgeted_peaks``: LagKV), the whole row otherwise.  A protected
    prompt is not known yet: its layers' hints are set with it (``Schedule.record_prompt``)."""
    budgets = layer_budgets(policy, num_layers)
    interval = policy.interval if policy.scorer is not None else 0
    unbudgeted = unbudgeted_peaks(policy, num_layers, horizon)
    hints = [own if b is None else horizon if policy.protect_prompt else min(horizon, b + interval)
             for b, own in zip(budgets, unbudgeted)]
    return {**scorer_fields(policy.scorer), "capacity_hints": hints}


def observer(policy: Policy):
    """The attention-row callback for the attention function (``attention.Observer``), or None
    when the scorer observes nothing."""
    scorer = policy.scorer
    if scorer is None or not scorer.needs.observes:
        return None
    return lambda layer, layer_idx, probs, query_pos: scorer.observe(layer, probs, query_pos)


@dataclass(frozen=True)
class StepPlan:
    """What the next decode step's forward pass does for the schedule.

    observer : attention.Observer | None
        The scorer's callback for this step's attention rows (None: the fused path).
    evict : tuple[(layer, budget), ...]
        Layers at their bound and at capacity bound + 1 that drop one token each inside the
        pass (``Schedule.evict_in_pass``), so that a compiled step contains the eviction.
    """

    observer: Callable | None = None
    evict: tuple[tuple[int, int], ...] = ()


# ---------------------------------------------------------------------------- the schedule
class Schedule:
    """When and how ``policy`` compresses ``store`` (rows of at most ``horizon`` tokens): the one
    object that decides what a store evicts, and asks the store to do it.

    A policy compresses at three kinds of moments (``Policy``'s schedule fields):

    * after each block of the prompt, for block-wise prefill eviction (``prefill_block``, CAOTE
      Sec. 2 Eqs. 3-7), unless the prompt is protected (then no prompt token may go);
    * at the end of the prompt: each row's prompt length is recorded (and, with ``protect_prompt``,
      every bounded layer's capacity sized for prompt + budget + interval), each layer drops its
      padding slots, then compresses the prompt when the policy does (``compress_prefill``);
    * every ``interval`` decode steps, each layer over its bound (the budget, + the longest prompt
      with ``protect_prompt``).  Every-step policies whose scorer allows any slot order
      (``Needs.slot_order_free``) drop the one token each layer is over inside the step
      (``StepPlan.evict``), the others after it.

    Two drivers use it.  ``DecodeSession`` knows its forward passes and calls ``after_block``,
    ``end_prompt`` and ``after_step`` once per pass.  ``kvsieve.hf.ScheduledCache`` learns of a
    pass only through ``update(layer)``, so it calls the per-layer ``compress_layer`` and
    ``finish_prompt_layer`` just before each layer is read again; layers are independent, so
    both keep the same tokens.

    ``budgets`` are the per-layer budgets (None: a layer the policy keeps whole), by default the
    policy's (``layer_budgets``).  ``on_compress`` is called right before each compression the
    session counts (its peak statistics read the store then).  Only a ``Schedule`` compresses,
    drops padding or records the prompt; the store's layers change their own state in the calls
    it makes.
    """

    def __init__(self, policy: Policy, store: Store, horizon: int, budgets: list[int | None] | None = None,
                 on_compress: Callable[[], None] | None = None):
        self.policy, self.store, self.horizon = policy, store, horizon
        self.budgets = layer_budgets(policy, len(store.layers)) if budgets is None else budgets
        self.block = policy.prefill_block_size()  # the prompt is read in blocks of this many tokens
        self.on_compress = on_compress or (lambda: None)
        scorer = policy.scorer
        self.observer = observer(policy)  # the attention-row callback for the attention function
        # Every-step policies that may drop tokens in place do so inside the step.
        self.evicts_in_step = (scorer is not None and scorer.needs.slot_order_free and not scorer.needs.selects
                               and policy.interval == 1 and not policy.allocator.ragged_heads
                               and not scorer.needs.cross_layer)
        self.steps = 0  # decode steps done

    # ------------------------------------------------------------------ when
    @property
    def compresses(self) -> bool:
        return self.policy.scorer is not None

    @property
    def compresses_blocks(self) -> bool:
        """Whether each prompt block is compressed as it arrives (a protected prompt has nothing to evict)."""
        return self.block is not None and not self.policy.protect_prompt

    @property
    def compresses_prompt(self) -> bool:
        """Whether the prompt is compressed once it is in (``compress_prefill``)."""
        return self.compresses and self.policy.compress_prefill

    def due(self, steps: int) -> bool:
        """Whether the compression of every ``interval`` decode steps falls on ``steps`` done."""
        return self.compresses and steps % self.policy.interval == 0

    def observes(self, step: int) -> bool:
        """Whether decode step ``step`` (0-based) must hand its attention rows to the scorer
        (never when it observes nothing): every step, unless the scorer keeps only the newest
        query's attention (``observes_last_only``); that is read only by the compression after
        steps I-1, 2I-1, ..., so the other steps run the fused attention path (no probabilities)."""
        if self.observer is None:
            return False
        return not self.policy.scorer.needs.observes_last_only or (step + 1) % self.policy.interval == 0

    def bound(self, budget: int | None) -> int | None:
        """Host-side upper bound on the tokens a layer of budget ``budget`` keeps per (row, head):
        the budget, or with ``protect_prompt`` the budget plus the longest prompt of the batch
        (``store.prompt_max``), so every row's generated tokens pass ``budget`` at the same step."""
        if budget is None or not self.policy.protect_prompt:
            return budget
        return budget + self.store.prompt_max

    def protected_prompt(self) -> torch.Tensor | None:
        """[B] prompt lengths to keep outside the budget (``protect_prompt``), or None: the policy
        does not protect its prompt, or the store does not know it yet (before ``record_prompt``)."""
        return self.store.prompt_len if self.policy.protect_prompt else None

    def pinned_prompt(self, budget: int | None, store: Store | None = None) -> torch.Tensor | None:
        """[B] the first positions of each row kept inside a layer's ``budget`` (``pin_prompt``: its
        prompt, or the first ``budget`` tokens of a longer one), or None; ``store``: the schedule's
        own, or the one a compiled step is handed."""
        prompt_len = (store or self.store).prompt_len
        if not self.policy.pin_prompt or budget is None or prompt_len is None:
            return None
        return prompt_len.clamp(max=budget)

    @property
    def keeps_prompt(self) -> bool:
        """Whether the store records each row's prompt length (a protected or pinned prompt)."""
        return self.compresses and (self.policy.protect_prompt or self.policy.pin_prompt)

    def layer_due(self, index: int) -> bool:
        """Host-side: does layer ``index`` hold more than its bound now (no device read)?"""
        if not self.compresses or (self.keeps_prompt and self.store.prompt_len is None):
            return False
        return self.policy.scorer.should_compress(self.store.layers[index], self.bound(self.budgets[index]))

    def any_due(self) -> bool:
        """Host-side: does any layer hold more than its bound now?"""
        return any(self.layer_due(index) for index in range(len(self.store.layers)))

    # ------------------------------------------------------------------ what
    def compress_layer(self, index: int) -> bool:
        """Compress layer ``index`` down to its budget if it is over its bound; True if it was.
        A cross-layer scorer compresses every layer at once (``compress``)."""
        if self.cross_layer:
            raise RuntimeError(f"{self.policy.name} chooses the same tokens in every layer: compress them together "
                               "(Schedule.compress)")
        if not self.layer_due(index):
            return False
        budget = self.budgets[index]
        compress_layer(self.store.layers[index], self.policy, budget, self.store.seen_tokens,
                       self.protected_prompt(), self.store.prompt_max, self.pinned_prompt(budget))
        return True

    @property
    def cross_layer(self) -> bool:
        """Each kv head keeps the same tokens in every layer (``Needs.cross_layer``)."""
        return self.compresses and self.policy.scorer.needs.cross_layer

    def compress(self) -> bool:
        """Compress every layer over its bound; True if any was."""
        if self.cross_layer:
            return self.compress_across_layers()
        return any([self.compress_layer(index) for index in range(len(self.store.layers))])

    def compress_across_layers(self) -> bool:
        """Every layer keeps the same tokens per (row, kv head), chosen by the mean over layers of
        the scorer's scores (``Needs.cross_layer``: TriAttention's ``per_head``, the official
        ``_select_per_head_independent``).  Every layer holds the same positions in the same slots
        (they were all compressed alike since the prompt), has the same budget and is due at the
        same step (``Policy`` checks both), so one protected score [B, H_kv, capacity] serves all."""
        layers = self.store.layers
        if not any(self.layer_due(index) for index in range(len(layers))):
            return False
        seen, budget = self.store.seen_tokens, self.budgets[0]
        scores = cross_layer_scores(layers, self.policy, seen, self.protected_prompt() if self.policy.protect_prompt
                                    else self.pinned_prompt(budget))
        bound = self.bound(budget)
        for layer in layers:
            keep_layer(layer, self.policy, budget, seen, scores.clone(), self.protected_prompt(), bound)
        return True

    # ------------------------------------------------------------------ the prompt (DecodeSession, ScheduledCache)
    def after_block(self, positions: torch.Tensor) -> None:
        """A prompt block is in, ``positions`` [B, P] of every prompt token so far (DEAD_POS on
        padding): with block-wise prefill eviction, compress now."""
        if not self.compresses_blocks:
            return
        self.store.set_seen((positions != DEAD_POS).sum(dim=1))
        self.on_compress()  # each block's tokens are held until this compression
        self.compress()

    def record_prompt(self, prompt_len: torch.Tensor) -> None:
        """The prompt is in: every row has seen its ``prompt_len`` [B] real tokens, and with
        ``protect_prompt`` each bounded layer's capacity makes room for its longest row's prompt
        (prompt + budget + interval)."""
        self.store.set_seen(prompt_len)
        if not self.keeps_prompt:
            return
        self.store.set_prompt(prompt_len)
        if not self.policy.protect_prompt:  # a pinned prompt counts inside the budget: the bound stays
            return
        for layer, budget in zip(self.store.layers, self.budgets):
            if budget is not None:
                layer.set_capacity_hint(min(self.horizon, self.bound(budget) + self.policy.interval))

    def drop_padding(self, index: int, grow_chunk: int) -> None:
        """Layer ``index`` after the prompt: drop its padding slots, leaving room for the appends
        until the next compression (``grow_chunk`` for ``full``)."""
        headroom = self.policy.interval if self.compresses else grow_chunk
        # a policy that leaves the prompt for its first decode-time compression (LazyEviction, AMS,
        # SkipKV) needs those appends beyond its capacity hint when the prompt exceeds the budget
        drop_dead_layer(self.store.layers[index], headroom, past_hint=self.compresses and not self.compresses_prompt)

    def finish_prompt_layer(self, index: int, grow_chunk: int) -> bool:
        """Layer ``index`` after the prompt (``ScheduledCache``, one layer at a time): padding
        dropped, then the prompt compressed if the policy does."""
        self.drop_padding(index, grow_chunk)
        return self.compresses_prompt and self.compress_layer(index)

    def finish_prompt(self, grow_chunk: int) -> bool:
        """Every layer after the prompt: padding dropped, then the prompt compressed if the policy
        does; True if any layer compressed."""
        for index in range(len(self.store.layers)):
            self.drop_padding(index, grow_chunk)
        return self.compresses_prompt and self.compress()

    def end_prompt(self, prompt_len: torch.Tensor, grow_chunk: int, static: bool = False) -> bool:
        """Every layer after the prompt (``DecodeSession``): the prompt recorded, padding dropped,
        the prompt compressed if the policy does, and with ``static`` room for every append until
        the next compression (or the end, for full).  True if any layer compressed."""
        self.record_prompt(prompt_len)
        if self.compresses_prompt:
            self.on_compress()
        compressed = self.finish_prompt(grow_chunk)
        if static:
            headroom = self.policy.interval if self.compresses else 0
            for layer in self.store.layers:
                layer.reserve(max(layer.capacity_hint, layer.max_len + headroom))
        return compressed

    # ------------------------------------------------------------------ decode steps (DecodeSession)
    def plan_step(self) -> StepPlan:
        """What the next decode step's pass does: observe or not, and which layers drop one token
        inside it (at their bound and at capacity bound + 1)."""
        observer = self.observer if self.observes(self.steps) else None
        if not self.evicts_in_step:
            return StepPlan(observer)
        bounds = [self.bound(b) for b in self.budgets]  # + the longest prompt if protected
        evict = tuple((i, b) for i, (layer, b, bound) in enumerate(zip(self.store.layers, self.budgets, bounds))
                      if b is not None and layer.max_len == bound and layer.capacity == bound + 1)
        return StepPlan(observer, evict)

    def evict_between_steps(self) -> None:
        """Evict after each step instead of inside it: host hooks (SkipKV's sentences, steering,
        trace recording) watch every step and compression, which a compiled step cannot call."""
        self.evicts_in_step = False

    def evict_in_pass(self, store: Store, evict: tuple[tuple[int, int], ...], peak: torch.Tensor) -> None:
        """Inside a decode step's pass (device work only, compiled with it): record the live tokens
        [B, L] before eviction into ``peak``, then layers ``evict`` drop one token each."""
        live = torch.stack([layer.lengths.sum(dim=1) for layer in store.layers], dim=1)
        torch.maximum(peak, live, out=peak)
        prompt_len = store.prompt_len if self.policy.protect_prompt else None
        for index, budget in evict:
            evict_in_place(store.layers[index], self.policy, budget, store.seen_tokens, excess=1, prompt_len=prompt_len,
                           pinned=self.pinned_prompt(budget, store))

    def after_step(self, plan: StepPlan, compress: bool = True) -> bool:
        """After a decode step's pass: the layers that evicted inside it get their new bound, and
        every ``interval`` steps each layer over its bound is compressed (not with ``compress``
        False: a benchmark times the compression apart).  True if any was."""
        for index, budget in plan.evict:
            self.store.layers[index].set_max_len(self.bound(budget))
        self.steps += 1
        if not compress or not self.due(self.steps) or not self.any_due():
            return False
        self.on_compress()
        self.compress()
        return True
