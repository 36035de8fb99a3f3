"""Policies: scorer x allocator x schedule, and the compression step they share.

* A **scorer** (one file per method in ``kvsieve/methods``) says how important each cached
  token is for each (row, kv head): ``score(layer, seen_tokens) -> [B, H_kv, capacity]``,
  higher is kept.  Stateful scorers declare per-token ``Needs.meta`` fields (compacted with
  K/V) and update them in ``observe`` from each step's attention rows.
* An **allocator** (``kvsieve/allocators.py``) turns scores into a keep mask: how many tokens
  each layer and head keeps.
* The **schedule** (fields of ``Policy``) says when to compress: at the end of prefill and
  every ``interval`` decode steps while a layer holds more than its budget; ``Schedule`` (at the
  end of this file) is the one object that acts on it for a cache.

``compress_layer`` does the rest once for every method: protect sinks and the recent window
(and, with ``protect_prompt``, each row's prompt, outside the budget), never keep dead slots, ask the allocator, and compact with one gather.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Protocol, runtime_checkable

import torch

from .allocators import Uniform
from .cache import DEAD_POS, SieveCache, SieveLayer
from .checks import SettingError, check_at_least, check_fields

SCORERS: dict[str, type["Scorer"]] = {}

# Block m of block-wise prefill eviction (``Policy.prefill_block``): CAOTE Sec. 4.1 uses 128.
PREFILL_BLOCK = 128


def register(name: str):
    """Class decorator: make a scorer available under ``name``."""

    def add(cls):
        if name in SCORERS:
            raise ValueError(f"scorer {name!r} registered twice")
        cls.name = name
        SCORERS[name] = cls
        return cls

    return add


@dataclass(frozen=True)
class About:
    """What ``kvsieve methods`` prints for a method: one line of what it does, and where its
    defaults come from (paper sections, official code)."""

    summary: str = ""
    source: str = ""


@dataclass(frozen=True)
class Needs:
    """What a scorer needs from the engine: one declared record, read by the engine only.

    meta : dict[str, float]
        Per-token state fields, each with the value new tokens start with; compacted with K/V
        by the one gather (``SieveLayer.meta``).
    kv_fields, kv_sums : tuple[str, ...]
        Per-token K/V statistics computed at append (``cache.KV_FIELDS``) and running sums over
        the live tokens (``cache.KV_SUMS``).
    observes : bool
        ``observe()`` gets every step's attention rows.
    observes_last_only : bool
        The observed state is only the newest query's attention (TOVA): between compressions
        the engine skips observing (``Policy.observes_step``).
    query_window : int
        Recent post-RoPE queries per layer the engine keeps for ``score``.
    per_token_hook : bool
        ``attach()`` yields a per-token host callback (SkipKV's sentence tracking): only a kvsieve
        decode loop can call it, not transformers' own generate (``kvsieve.hf``).
    slot_order_free : bool
        Scores are per token and ignore which slot neighbours which (no pooling along the slots,
        no partitions): the engine may evict in place (``SieveLayer.evict``), moving the newest
        tokens into freed slots, instead of re-gathering the whole cache.
    aligned_heads : bool
        Scores are combined across kv heads slot by slot, which needs every head of a layer to
        hold the same tokens (so no ragged per-head allocator).
    whole_layers : int
        The first ``whole_layers`` layers are never compressed (Knorm's two): they keep every
        token and get no budget (``Policy.layer_budgets``).
    uses_budget : bool
        False: the scorer's own ``select()`` decides how many tokens stay (LagKV's partitions).
    fitted_fields : tuple[str, ...]
        A scorer without ``uses_budget`` that maps a budget to its own settings (``fit_budget``)
        names the fields the fit sets, per batch (LagKV: lag, ratio, ...); empty otherwise.
    traceable : bool
        False: ``score()`` uses a host object ``torch.compile`` cannot trace (random's
        ``torch.Generator``), so a session that would evict inside a compiled step says so once
        and decodes eagerly (``kvsieve.session``).
    """

    meta: dict[str, float] = field(default_factory=dict)
    kv_fields: tuple[str, ...] = ()
    kv_sums: tuple[str, ...] = ()
    observes: bool = False
    observes_last_only: bool = False
    query_window: int = 0
    per_token_hook: bool = False
    slot_order_free: bool = False
    aligned_heads: bool = False
    whole_layers: int = 0
    uses_budget: bool = True
    fitted_fields: tuple[str, ...] = ()
    traceable: bool = True

    @property
    def fits_budget(self) -> bool:
        """A budget is mapped to the scorer's own settings (``Scorer.fit_budget``)."""
        return bool(self.fitted_fields)


BudgetRule = Callable[[int], int]


@dataclass(frozen=True)
class Defaults:
    """A scorer's schedule when the user sets none (``Policy``'s fields of the same names).

    sinks : int
        First positions never evicted.
    recent : int | (budget -> int)
        Recent positions never evicted, or the method's rule from the budget (H2O: budget // 2;
        a rule may refuse a budget, naming the fix).
    interval : int | (budget -> int)
        Decode steps between compressions.  A number is capped at ``budget // 2`` for a budgeted
        scorer (``capped_interval``); a rule is the method's own and used as it returns
        (LazyEviction: W, refusing a budget below 2W).
    compress_prefill : bool
        Compress the prompt right after prefill when it exceeds the budget.
    protect_prompt : bool
        Keep every prompt token outside the budget (each method file cites its value).
    prefill_block : int
        0: the prompt is read whole; m > 0: block-wise prefill eviction is on by default, in blocks
        of m tokens (CAOTE Sec. 4.1: 128), also the block of an explicit ``prefill_block=True``.
    recent_doc, interval_doc : str
        How ``recent`` and ``interval`` depend on the settings, for ``kvsieve methods``.
    """

    sinks: int = 0
    recent: int | BudgetRule = 0
    interval: int | BudgetRule = 1
    compress_prefill: bool = True
    protect_prompt: bool = False
    prefill_block: int = 0
    recent_doc: str = ""
    interval_doc: str = ""

    def recent_for(self, budget: int | None) -> int:
        """The recent window at ``budget``."""
        return self.recent(budget) if callable(self.recent) else self.recent

    def interval_for(self, budget: int | None, uses_budget: bool = True) -> int:
        """Decode steps between compressions at ``budget``: the method's rule, or its number capped at
        ``budget // 2`` for a budgeted scorer (``capped_interval``, see ``Policy``)."""
        if callable(self.interval):
            return self.interval(budget)
        return capped_interval(self.interval, budget if uses_budget else None)

    def describe(self) -> dict[str, Any]:
        """sinks, recent, interval and protect_prompt as ``kvsieve methods`` lists them."""
        recent = self.recent_doc or (self.recent if not callable(self.recent) else "budget rule")
        interval = self.interval_doc or (self.interval if not callable(self.interval) else "budget rule")
        return {"sinks": self.sinks, "recent": recent, "interval": interval, "protect_prompt": self.protect_prompt}


@dataclass(frozen=True)
class HostHooks:
    """Host callbacks a scorer's ``attach`` may yield for the decode loop (a bare callable is
    ``on_tokens``).

    on_tokens : (token_ids [B, T], query_pos [B, T], rows [B]) -> None
        Called before every forward with the tokens about to be appended (``query_pos``
        DEAD_POS on padding; ``rows``: each cache row's index in the original batch).
    on_rows_leave : (keep [B']) -> None
        Called right before finished rows leave the cache; ``keep`` are the rows that stay.
    """

    on_tokens: Callable | None = None
    on_rows_leave: Callable | None = None

    @staticmethod
    def of(yielded: "HostHooks | Callable | None") -> "HostHooks":
        """What an ``attach`` yielded, as ``HostHooks`` (a bare callable is ``on_tokens``)."""
        return yielded if isinstance(yielded, HostHooks) else HostHooks(on_tokens=yielded)


@runtime_checkable
class Hook(Protocol):
    """Something ``generate(..., hooks=[...])`` runs beside the policy for one call (SkipKV's
    adaptive steering, ``kvsieve.steering.Steering``, is one).

    ``attach(model, tokenizer)`` is the contract a scorer's ``attach`` has: a context manager
    scoped to the call that may yield ``HostHooks`` (or a bare ``on_tokens``).  ``settings()``
    is stored in the call's settings record under ``name`` (``settings["steering"]``), so
    results say what ran.
    """

    name: str

    def attach(self, model, tokenizer) -> ContextManager: ...

    def settings(self) -> dict: ...


@dataclass
class Scorer:
    """Base class of every scoring method.

    Its whole contract with the engine: ``needs`` (what it reads and when, a ``Needs``),
    ``defaults`` (its schedule, a ``Defaults``), ``about`` (what ``kvsieve methods`` prints) and
    the hooks below.  Dataclass fields are the method's hyperparameters.  A scorer whose needs or
    defaults depend on its fields sets them in ``__post_init__`` with ``dataclasses.replace``.
    """

    name: ClassVar[str] = ""
    about: ClassVar[About] = About()
    needs: ClassVar[Needs] = Needs()
    defaults: ClassVar[Defaults] = Defaults()

    def attach(self, model, tokenizer):
        """Context manager entered by ``generate`` for one call.  It may yield host callbacks
        (``HostHooks``, or a bare ``on_tokens`` callable) the loop calls.  Scorers that need token
        text or hidden states (SkipKV) set up here and clean up on exit; the default yields None."""
        return contextlib.nullcontext()

    def observe(self, layer: SieveLayer, probs: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor | None:
        """Update per-token state from this step's attention rows [B, H_kv, G, T, capacity]
        (zero rows for padding queries); ``query_pos`` [B, T] are the queries' positions.
        May return weights [B, H_kv, R, capacity] whose mixes of V the attention pass computes
        alongside its output (``layer.step_results["value_mix"]``, see ``attention.Observer``)."""

    def score(self, layer: SieveLayer, seen_tokens: torch.Tensor) -> torch.Tensor:
        """[B, H_kv, capacity] importance of each slot (dead slots may hold anything)."""
        raise NotImplementedError

    def select(self, layer: SieveLayer, scores: torch.Tensor, budget: int | None, seen_tokens: torch.Tensor):
        """Optional own selection: return ``(keep_mask [B, H_kv, capacity], K or None)`` to
        bypass the allocator (methods whose kept count is not a budget, e.g. LagKV's
        partitions), or ``None`` to let the allocator choose.  With ``protect_prompt``
        ``budget`` is a [B, 1] tensor, each row's prompt length + budget (``row_budget``), and
        the prompt tokens score +inf like the other protected tokens."""
        return None

    def should_compress(self, layer: SieveLayer, budget: int | None) -> bool:
        """Host-side decision (no device read) whether this layer compresses now."""
        return budget is not None and layer.max_len > budget

    def peak_bound(self, horizon: int, feed: "Feed") -> int | None:
        """With no budget: the most tokens a row of at most ``horizon`` tokens fed as ``feed``
        says holds per kv head in a layer this scorer compresses, the whole prompt's wait for its
        first check apart; None when only the horizon bounds it.  Scorers that keep a bounded
        cache by their own settings (LagKV's partitions, Eq. 10) say so, and the cache never
        allocates past it (``Policy.unbudgeted_peaks``)."""
        return None

    def fit_budget(self, budget: int, horizon: int, feed: "Feed") -> "Scorer":
        """A copy whose own settings keep at most ``budget`` tokens per row over ``horizon`` tokens
        fed as ``feed`` says (only scorers with ``needs.fitted_fields``, e.g. LagKV)."""
        raise NotImplementedError(f"{self.name} has no budget-to-settings rule")


def capped_interval(interval: int, budget: int | None) -> int:
    """A default interval capped at ``budget // 2`` (at least 1), so that a budget stays a bound:
    the cache peaks at budget + interval <= 1.5 x budget (issue 28).  No budget: ``interval``."""
    return interval if budget is None else max(1, min(interval, int(budget) // 2))


HEAD_REDUCTIONS = ("mean", "max", "sum")


def check_choice(value, allowed, what: str) -> None:
    """Raise a ValueError naming the allowed values (for scorer ``__post_init__`` checks)."""
    if value not in allowed:
        raise ValueError(f"{what} must be one of {list(allowed)}, got {value!r}")


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


@dataclass(frozen=True)
class Feed:
    """How ``DecodeSession`` hands a batch's tokens to the cache between compression checks: what
    a self-sizing scorer's budget fit (``Scorer.fit_budget``) bounds its peak over.

    prompt : int
        The batch's longest prompt in real tokens; 0 when not known (``kvsieve.hf`` builds its
        cache before it sees the prompt).
    block : int | None
        ``Policy.prefill_block_size()``: the prompt arrives in blocks of this many tokens, each
        followed by a check.  None: it arrives whole and is checked once after prefill (without
        ``compress_prefill``, first at decode step ``interval``).
    interval : int
        Decode steps between checks (``Policy.interval``).
    compress_prefill : bool
        ``Policy.compress_prefill``.
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


@dataclass
class Policy:
    """A scorer with its budget, allocator and schedule.

    Parameters
    ----------
    scorer : Scorer | None
        ``None`` means no eviction (``full``).
    budget : int | None
        Tokens kept per (row, kv head) after a compression, on average over layers and heads.
    allocator : Allocator
        How the budget is split over layers and heads (``uniform``, ``pyramid``, ``adakv``).
    sinks, recent : int | None
        First ``sinks`` positions and last ``recent`` positions of each row are never
        evicted; ``None`` takes the scorer's default.
    interval : int | None
        Compress every ``interval`` decode steps (the cache peaks at budget + interval).
        ``None`` takes the scorer's default (``Defaults.interval_for``), capped at ``budget // 2``
        for a budgeted scorer so that a budget stays a bound (the cache peaks at 1.5 x budget at
        most): AMS's and ``expected``'s 512 (AMS Table 15) are set for budgets of 2k tokens and
        up, and at budget 128 in a 512-token run they would never compress (issue 28).  ``lazy``,
        whose interval is its window W (Alg. 1), refuses a budget below 2W instead of capping.
        An explicit interval is kept as given.
    compress_prefill : bool | None
        Compress the prompt right after prefill when it exceeds the budget; ``None`` takes
        the scorer's default (``Defaults.compress_prefill``).
    protect_prompt : bool | None
        True: the prompt tokens of each row (positions below its prompt length) are never evicted
        and do not count against the budget, which then bounds the generated tokens only: a layer
        keeps ``prompt_len[row] + budget`` tokens per head, per row (rows of a left-padded batch
        have their own prompt lengths, so their own bounds).  False: prompt and generated tokens
        compete for one budget.  ``None`` takes the scorer's default (``Defaults.protect_prompt``:
        its paper's reading, cited in each method file).  Needs a budgeted method: LagKV's
        partitions set their own size and refuse it.
    prefill_block : bool | int | None
        ``None`` takes the scorer's default (``Defaults.prefill_block``: on for CAOTE).
        Read the prompt in blocks and compress after each one (block-wise prefill eviction,
        CAOTE Sec. 2 Eqs. 3-7), whatever ``GenerateConfig.prefill_chunk`` says.  ``True``: blocks
        of the scorer's ``Defaults.prefill_block`` if it sets one, else ``PREFILL_BLOCK`` (128, CAOTE
        Sec. 4.1), so a base compared with CAOTE prefills the same way (the paper's Table 10);
        an integer: blocks of that many tokens.
    """

    scorer: Scorer | None
    budget: int | None = None
    allocator: Any = None
    sinks: int | None = None
    recent: int | None = None
    interval: int | None = None
    compress_prefill: bool | None = None
    prefill_block: bool | int | None = None
    protect_prompt: bool | None = None

    def __post_init__(self):
        check_fields(self)  # every later check may assume the annotated types
        defaults = self.scorer.defaults if self.scorer is not None else Defaults()
        if self.compress_prefill is None:
            self.compress_prefill = defaults.compress_prefill
        if self.protect_prompt is None:
            self.protect_prompt = defaults.protect_prompt
        if self.prefill_block is None:
            self.prefill_block = defaults.prefill_block > 0
        if self.allocator is None:
            self.allocator = Uniform()
        if self.scorer is None:
            return
        needs = self.scorer.needs
        if needs.uses_budget and (self.budget is None or int(self.budget) <= 0):
            raise SettingError("budget", f"method {self.scorer.name!r} needs a positive {{name}} (tokens per row and "
                                         "kv head)")
        if not needs.uses_budget and not needs.fits_budget and self.budget is not None:
            raise SettingError("budget", f"method {self.scorer.name!r} sets its own cache size; drop {{name}}")
        self.sinks = defaults.sinks if self.sinks is None else self.sinks
        # the interval before the recent window: a scorer that refuses a budget for its default
        # interval (lazy: B < 2W) says so before any narrower check of its recent window
        if self.interval is None:
            self.interval = defaults.interval_for(self.budget, needs.uses_budget)
        self.recent = defaults.recent_for(self.budget) if self.recent is None else self.recent
        for name, least in (("sinks", 0), ("recent", 0), ("interval", 1)):
            check_at_least(name, getattr(self, name), least)
        if self.prefill_block is not True and self.prefill_block is not False and self.prefill_block < 1:
            raise SettingError("prefill_block", f"{{name}} must be true, false or a block size >= 1, got "
                                                f"{self.prefill_block}")
        if self.protect_prompt and not needs.uses_budget:
            raise ValueError(
                f"{self.scorer.name} keeps tokens by its own rule (partitions), not by a budget, so its prompt "
                "cannot be set apart from the budget; drop protect_prompt (set it false)")
        if needs.aligned_heads and self.allocator.ragged_heads:
            raise ValueError(
                f"{self.scorer.name} with these settings averages scores across kv heads slot by slot, "
                f"which needs heads to keep the same tokens; allocator {self.allocator.name!r} makes them "
                "differ. Use a per-head setting of the method or the uniform/pyramid allocator."
            )
        if self.budget is not None and self.budget < self.sinks + self.recent:
            raise SettingError(
                "budget", f"budget {self.budget} is smaller than the protected tokens: sinks {self.sinks} + recent "
                f"{self.recent}; raise {{name}} to at least {self.sinks + self.recent} or lower sinks/recent"
            )

    def prefill_block_size(self) -> int | None:
        """Tokens per block of block-wise prefill eviction, or None without it."""
        if self.scorer is None or self.prefill_block is False:  # 0 is refused in __post_init__
            return None
        if self.prefill_block is True:
            return self.scorer.defaults.prefill_block or PREFILL_BLOCK
        return int(self.prefill_block)

    @property
    def name(self) -> str:
        return "full" if self.scorer is None else self.scorer.name

    def settings(self) -> dict[str, Any]:
        """Everything that defines this policy, for JSON output and result files."""
        out: dict[str, Any] = {"method": self.name}
        if self.scorer is None:
            return out
        out.update(budget=self.budget, sinks=self.sinks, recent=self.recent, interval=self.interval,
                   compress_prefill=self.compress_prefill, prefill_block=self.prefill_block,
                   protect_prompt=self.protect_prompt, allocator=self.allocator.name)
        out.update({f.name: getattr(self.scorer, f.name) for f in dataclasses.fields(self.scorer) if f.init})
        out.update({f"allocator_{f.name}": getattr(self.allocator, f.name) for f in dataclasses.fields(self.allocator)})
        return out

    def feed(self, prompt: int = 0) -> Feed:
        """This policy's schedule as the cache sees it, for a batch whose longest prompt is ``prompt``."""
        return Feed(prompt=prompt, block=self.prefill_block_size(), interval=self.interval,
                    compress_prefill=self.compress_prefill)

    def for_horizon(self, horizon: int, prompt: int = 0) -> "Policy":
        """The policy to run for rows of at most ``horizon`` tokens whose longest prompt is
        ``prompt`` (0: not known): a self-sizing scorer given a budget (``fits_budget``) gets
        settings fitted to it and this schedule; every other policy is returned as is."""
        if self.scorer is None or self.scorer.needs.uses_budget or self.budget is None:
            return self
        fitted = self.scorer.fit_budget(int(self.budget), horizon, self.feed(prompt))
        return dataclasses.replace(self, scorer=fitted)

    def layer_budgets(self, num_layers: int) -> list[int | None]:
        if self.scorer is None or self.budget is None:
            return [None] * num_layers
        budgets = self.allocator.layer_budgets(self.budget, num_layers, self.sinks + self.recent)
        return [b if i >= self.scorer.needs.whole_layers else None for i, b in enumerate(budgets)]

    def unbudgeted_peaks(self, num_layers: int, horizon: int, prompt: int = 0) -> list[int]:
        """Per layer, the most tokens a row of at most ``horizon`` tokens holds per kv head when
        the layer has no budget, the prompt's wait for its first check apart: the scorer's own
        bound (``Scorer.peak_bound``) on the layers it compresses, the horizon elsewhere."""
        own = None if self.scorer is None else self.scorer.peak_bound(horizon, self.feed(prompt))
        whole = 0 if self.scorer is None else self.scorer.needs.whole_layers
        return [horizon if own is None or i < whole else min(horizon, own) for i in range(num_layers)]

    def layer_bound(self, cache: SieveCache, budget: int | None) -> int | None:
        """Host-side upper bound on the tokens a layer of budget ``budget`` keeps per (row, head):
        the budget, or with ``protect_prompt`` the budget plus the longest prompt of the batch
        (``cache.prompt_max``), so every row's generated tokens pass ``budget`` at the same step."""
        if budget is None or not self.protect_prompt:
            return budget
        return budget + cache.prompt_max

    def protected_prompt(self, cache: SieveCache) -> torch.Tensor | None:
        """[B] prompt lengths to keep outside the budget (``protect_prompt``), or None: the policy
        does not protect its prompt, or the cache does not know it yet (before ``set_prompt``)."""
        return cache.prompt_len if self.protect_prompt else None

    def observes_step(self, step: int) -> bool:
        """Whether decode step ``step`` (0-based) must hand its attention rows to the scorer
        (never when it observes nothing): every step, unless the scorer keeps only the newest query's attention
        (``observes_last_only``); that is read only by the compression after steps
        I-1, 2I-1, ..., so the other steps run the fused attention path (no probabilities)."""
        if self.scorer is None or not self.scorer.needs.observes:
            return False
        return not self.scorer.needs.observes_last_only or (step + 1) % self.interval == 0

    def observer(self):
        """The attention-row callback for the attention function, or None."""
        if self.scorer is None or not self.scorer.needs.observes:
            return None
        return lambda layer, layer_idx, probs, query_pos: self.scorer.observe(layer, probs, query_pos)


def indices_from_mask(keep: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a keep mask [B, H, S] into ``kept_idx`` [B, H, K] (kept slots first, in slot
    order, then zeros) and ``new_lengths`` [B, H]."""
    S = keep.shape[-1]
    slot = torch.arange(S, device=keep.device).expand_as(keep)
    order = torch.where(keep, slot, S).sort(dim=-1).values[..., :K]
    return order.masked_fill(order == S, 0), keep.sum(dim=-1)


def top_k_indices(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as ``indices_from_mask`` on a top-``k`` mask, without building the mask:
    ``kept_idx`` [B, H, k] in slot order (slots scored -inf, i.e. dead, moved to the end and
    zeroed) and ``new_lengths`` [B, H]."""
    S = scores.shape[-1]
    values, idx = scores.topk(k, dim=-1)
    dead = values == float("-inf")
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


def protected_scores(layer: SieveLayer, policy: Policy, seen_tokens: torch.Tensor,
                     prompt_len: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H_kv, capacity] float scores of one layer with the schedule applied: sinks, the
    recent window and (``prompt_len`` [B] given, ``protect_prompt``) every prompt token at +inf,
    dead slots at -inf (a copy: never the scorer's own state)."""
    pos = layer.meta["pos"]
    scores = policy.scorer.score(layer, seen_tokens).float()  # [B, H, cap]
    keep = protected_mask(pos, seen_tokens, policy.sinks, policy.recent) if policy.sinks or policy.recent else None
    if prompt_len is not None:
        keep = prompt_mask(pos, prompt_len) if keep is None else keep | prompt_mask(pos, prompt_len)
    if keep is not None:
        scores = scores.masked_fill(keep, float("inf"))
    else:
        scores = scores.clone()  # never write into a scorer's own state (H2O returns its sums)
    return scores.masked_fill_(pos == DEAD_POS, float("-inf"))


def evict_in_place(layer: SieveLayer, policy: Policy, budget: int, seen_tokens: torch.Tensor, excess: int,
                   scores: torch.Tensor | None = None, prompt_len: torch.Tensor | None = None) -> None:
    """Drop the ``excess`` lowest-scored tokens of every head over ``budget`` (in place, see
    ``SieveLayer.evict``): device work only, so a compiled decode step can contain it; the
    caller sets ``layer.max_len``.  ``scores``: ``protected_scores`` when already computed (a
    scorer is asked once per compression: ``random`` draws new scores on every call).
    ``prompt_len`` [B] (``protect_prompt``): each row keeps its prompt and ``budget`` more."""
    if scores is None:
        scores = protected_scores(layer, policy, seen_tokens, prompt_len)
    lowest = scores.masked_fill_(layer.meta["pos"] == DEAD_POS, float("inf")).topk(excess, dim=-1, largest=False).indices
    layer.evict(lowest, (layer.lengths - row_budget(budget, prompt_len)).clamp(min=0, max=excess))


def compress_layer(layer: SieveLayer, policy: Policy, budget: int | None, seen_tokens: torch.Tensor,
                   prompt_len: torch.Tensor | None = None, prompt_max: int = 0) -> None:
    """Evict down to ``budget`` tokens per (row, kv head) in one layer (no-op if it fits).

    With ``prompt_len`` [B] (``Policy.protect_prompt``) row r keeps its whole prompt and at most
    ``budget`` other tokens, ``prompt_len[r] + budget`` in all; ``prompt_max`` is a host-side
    upper bound on ``prompt_len`` (``SieveCache.prompt_max``), so no step reads the device for it."""
    scorer = policy.scorer
    bound = budget if budget is None or prompt_len is None else budget + prompt_max
    if not scorer.should_compress(layer, bound):
        return
    dead = layer.meta["pos"] == DEAD_POS
    scores = protected_scores(layer, policy, seen_tokens, prompt_len)
    chosen = scorer.select(layer, scores, budget if budget is None else row_budget(budget, prompt_len), seen_tokens)
    if chosen is None and can_evict_in_place(layer, policy, bound):
        evict_in_place(layer, policy, budget, seen_tokens, excess=layer.max_len - bound, scores=scores,
                       prompt_len=prompt_len)
        layer.max_len = bound
        return
    if chosen is None and not policy.allocator.ragged_heads and prompt_len is None:
        kept_idx, new_lengths = top_k_indices(scores, min(layer.max_len, budget))
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


def can_evict_in_place(layer: SieveLayer, policy: Policy, budget: int) -> bool:
    """In place when the scorer allows any slot order, the allocator keeps the same count in
    every head, and the layer is already at its steady capacity (budget + interval), so that
    nothing would be returned by reallocating (right after prefill it would).  ``budget``: the
    layer's bound (with a protected prompt, budget + ``SieveCache.prompt_max``)."""
    return (policy.scorer.needs.slot_order_free and not policy.allocator.ragged_heads
            and layer.capacity <= budget + policy.interval and layer.max_len - budget <= policy.interval)


def set_prompt_bounds(cache: SieveCache, policy: Policy, budgets: list[int | None], horizon: int,
                      prompt_len: torch.Tensor) -> None:
    """At the end of prefill, with ``protect_prompt``: record each row's prompt length [B] and give
    every bounded layer the capacity its longest row needs (prompt + budget + interval)."""
    cache.set_prompt(prompt_len)
    for layer, budget in zip(cache.layers, budgets):
        if budget is not None:
            layer.capacity_hint = min(horizon, policy.layer_bound(cache, budget) + policy.interval)


def drop_dead_layer(layer: SieveLayer, headroom: int, past_hint: bool = False) -> None:
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


# ---------------------------------------------------------------------------- the schedule
class Schedule:
    """When and how ``policy`` compresses ``cache`` (rows of at most ``horizon`` tokens): the one
    object that decides when a policy compresses a cache, and does it.

    A policy compresses at three kinds of moments (``Policy``'s schedule fields):

    * after each block of the prompt, for block-wise prefill eviction (``prefill_block``, CAOTE
      Sec. 2 Eqs. 3-7), unless the prompt is protected (then no prompt token may go);
    * at the end of the prompt: each row's prompt length is recorded (and, with ``protect_prompt``,
      every bounded layer's capacity sized for prompt + budget + interval), each layer drops its
      padding slots, then compresses the prompt when the policy does (``compress_prefill``);
    * every ``interval`` decode steps, each layer over its bound (the budget, + the longest prompt
      with ``protect_prompt``).

    Two drivers use it.  ``DecodeSession`` (kvsieve's own loop) knows its forward passes and calls
    the cache-wide methods once per pass.  ``kvsieve.hf.ScheduledCache`` (transformers' ``generate``)
    learns of a pass only through ``update(layer)``, so it asks the same questions and calls the
    per-layer methods, one layer at a time, just before each layer is read again; layers are
    independent, so both keep the same tokens.

    ``budgets`` are the per-layer budgets (None: a layer the policy keeps whole), by default the
    policy's (``Policy.layer_budgets``).  Only a ``Schedule`` compresses, drops padding or records
    the prompt; the cache's layers change their own state in the calls it makes.
    """

    def __init__(self, policy: Policy, cache: SieveCache, horizon: int, budgets: list[int | None] | None = None):
        self.policy, self.cache, self.horizon = policy, cache, horizon
        self.budgets = policy.layer_budgets(len(cache.layers)) if budgets is None else budgets
        self.block = policy.prefill_block_size()  # the prompt is read in blocks of this many tokens

    # ------------------------------------------------------------------ when
    @property
    def compresses(self) -> bool:
        return self.policy.scorer is not None

    @property
    def compresses_blocks(self) -> bool:
        """Whether each prompt block is compressed as it arrives (a protected prompt has nothing to evict)."""
        return self.block is not None and not self.policy.protect_prompt

    def due(self, steps: int) -> bool:
        """Whether the compression of every ``interval`` decode steps falls on ``steps`` done."""
        return self.compresses and steps % self.policy.interval == 0

    def layer_due(self, index: int) -> bool:
        """Host-side: does layer ``index`` hold more than its bound now (no device read)?"""
        policy = self.policy
        if not self.compresses or (policy.protect_prompt and self.cache.prompt_len is None):
            return False
        bound = policy.layer_bound(self.cache, self.budgets[index])
        return policy.scorer.should_compress(self.cache.layers[index], bound)

    def any_due(self) -> bool:
        """Host-side: does any layer hold more than its bound now?"""
        return any(self.layer_due(index) for index in range(len(self.cache.layers)))

    # ------------------------------------------------------------------ what
    def compress_layer(self, index: int) -> bool:
        """Compress layer ``index`` down to its budget if it is over its bound; True if it was."""
        if not self.layer_due(index):
            return False
        compress_layer(self.cache.layers[index], self.policy, self.budgets[index], self.cache.seen_tokens,
                       self.policy.protected_prompt(self.cache), self.cache.prompt_max)
        return True

    def compress(self) -> bool:
        """Compress every layer over its bound; True if any was."""
        return any([self.compress_layer(index) for index in range(len(self.cache.layers))])

    def end_prompt(self, prompt_len: torch.Tensor) -> None:
        """The prompt is in: every row has seen its ``prompt_len`` [B] real tokens, and with
        ``protect_prompt`` each bounded layer's capacity makes room for its longest row's prompt."""
        self.cache.seen_tokens = prompt_len
        if self.compresses and self.policy.protect_prompt:
            set_prompt_bounds(self.cache, self.policy, self.budgets, self.horizon, prompt_len)

    @property
    def compresses_prompt(self) -> bool:
        """Whether the prompt is compressed once it is in (``compress_prefill``)."""
        return self.compresses and self.policy.compress_prefill

    def drop_padding(self, index: int, grow_chunk: int) -> None:
        """Layer ``index`` after the prompt: drop its padding slots, leaving room for the appends
        until the next compression (``grow_chunk`` for ``full``)."""
        headroom = self.policy.interval if self.compresses else grow_chunk
        # a policy that leaves the prompt for its first decode-time compression (LazyEviction, AMS,
        # SkipKV) needs those appends beyond its capacity hint when the prompt exceeds the budget
        drop_dead_layer(self.cache.layers[index], headroom, past_hint=self.compresses and not self.compresses_prompt)

    def finish_prompt(self, grow_chunk: int) -> bool:
        """Every layer after the prompt (``DecodeSession``): padding dropped, then the prompt
        compressed if the policy does.  True if any layer compressed."""
        for index in range(len(self.cache.layers)):
            self.drop_padding(index, grow_chunk)
        return self.compresses_prompt and self.compress()

    def finish_prompt_layer(self, index: int, grow_chunk: int) -> bool:
        """``finish_prompt`` for layer ``index`` alone (``ScheduledCache``, one layer at a time)."""
        self.drop_padding(index, grow_chunk)
        return self.compresses_prompt and self.compress_layer(index)
