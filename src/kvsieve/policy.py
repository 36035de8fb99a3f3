"""The contract a method author reads: register a scorer, declare what it needs, set its defaults.

* A **scorer** (one file per method in ``kvsieve/methods``) says how important each cached
  token is for each (row, kv head): ``score(layer, seen_tokens) -> [B, H_kv, capacity]``,
  higher is kept, over a read-only view of the layer (``kvsieve.engine.LayerReader``).
  Stateful scorers declare per-token ``Needs.meta`` fields (kept with K/V by the store) and
  update them in ``observe`` from each step's attention rows.
* ``Defaults`` are the method's schedule when the user sets none; ``Policy`` is a scorer with its
  budget, allocator (``kvsieve/allocators.py``) and schedule settings, checked on construction.

Scores become keep-sets in ``kvsieve.schedule``; helpers shared by methods: ``methods/_common.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from .allocators import Uniform
from .checks import SettingError, check_at_least, check_fields

if TYPE_CHECKING:  # schedule imports this module
    from .schedule import Feed

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
    """What ``kvsieve methods`` prints: what a method does, where its defaults come from."""

    summary: str = ""
    source: str = ""


@dataclass(frozen=True)
class Needs:
    """What a scorer needs from the engine: one declared record, read by the engine only.

    meta : dict[str, float]
        Per-token state fields, each with the value new tokens start with; moved with K/V.
    kv_fields, kv_sums : tuple[str, ...]
        Per-token K/V statistics at append (``cache.KV_FIELDS``), running sums over live tokens (``cache.KV_SUMS``).
    observes : bool; observes_last_only : bool
        ``observe()`` gets every step's attention rows, or only the newest query's (TOVA: steps between compressions skip it).
    observes_steps : bool
        ``observe(..., steps=True)`` takes T decode steps' rows in one call and leaves the state T
        calls of one row leave (vLLM's worker replays a request's queries since a compaction so).
    query_window : int; attends_window : bool
        Recent post-RoPE queries per layer the engine keeps for ``score``, which attends them over the
        cache (SnapKV) unless ``attends_window`` is False (Expected's statistics; AMS's own, in chunks).
    per_token_hook : bool
        ``attach()`` yields a per-token host callback (SkipKV's sentences).
    sentences : tuple[str, ...]
        The token texts that end a sentence (SkipKV's delimiter set D) for a scorer that reads a
        ``methods.skipkv.SentenceTable`` (each token's sentence, each sentence's last-layer hidden
        states), fed by ``attach`` or handed over by ``read_sentences`` (vLLM's worker); empty for the rest.
    slot_order_free : bool; selects : bool
        What is kept does not depend on the slot order (per-token scores, or neighbours read by
        position: AMS): engines may move kept tokens into freed slots (``SieveLayer.evict``).  Unless
        ``select`` makes the keep-set (``selects``: AMS, LagKV), kvsieve's may drop by scores alone.
    aligned_heads : bool
        Scores are combined across kv heads slot by slot, which needs every head of a layer to
        hold the same tokens (so no ragged per-head allocator).
    heads_combined_by : str
        How an ``aligned_heads`` scorer combines its kv heads slot by slot, if by one reduction:
        "mean" (TOVA's ``heads="layer"``), "max" (TriAttention's ``per_layer``), or "" (unknown).
        Tensor-parallel workers combine their parts so (``vllm.store.heads_combiner``).
    whole_layers : int
        The first ``whole_layers`` layers are never compressed and get no budget (Knorm's two).
    uses_budget : bool; count_rule : (int -> int) | None
        False: the scorer's own ``select()`` decides how many tokens stay (LagKV's partitions);
        ``count_rule``: that count from n tokens seen alone (LagKV's Eq. 10), for vLLM's scheduler.
    fitted_fields : tuple[str, ...]
        A scorer without ``uses_budget`` that maps a budget to its own settings (``Scorer.sized``)
        names the fields the fit sets, per batch (LagKV: lag, ratio, ...); empty otherwise.
    traceable : bool
        False: ``score()`` uses a host object ``torch.compile`` cannot trace (random's generator): decoded eagerly.
    cross_layer : bool
        Each kv head keeps the same tokens in every layer, by the mean over layers of each layer's
        scores (TriAttention's ``per_head``, ``Schedule.compress_across_layers``).
    rows_coupled : bool
        A row's scores read other rows (AMS's released batch segmentation): vLLM scores it alone.
    stacks_layers, compares_keys, reads_values : bool
        Scoring reads nothing of a layer but its rows (no layer index, random draw or state between calls): vLLM's
        worker may score layers' rows as one batch (``store._Batch``), sized by a key similarity [S, S] where
        ``compares_keys`` (R-KV, SkipKV); it gathers values only for a scorer that reads them (``reads_values``).
    """

    meta: dict[str, float] = field(default_factory=dict)
    kv_fields: tuple[str, ...] = ()
    kv_sums: tuple[str, ...] = ()
    observes: bool = False
    observes_last_only: bool = False
    observes_steps: bool = False
    query_window: int = 0
    attends_window: bool = True
    per_token_hook: bool = False
    sentences: tuple[str, ...] = ()
    slot_order_free: bool = False
    selects: bool = False
    aligned_heads: bool = False
    heads_combined_by: str = ""
    whole_layers: int = 0
    uses_budget: bool = True
    count_rule: Callable[[int], int] | None = None
    fitted_fields: tuple[str, ...] = ()
    traceable: bool = True
    cross_layer: bool = False
    rows_coupled: bool = False
    stacks_layers: bool = False
    compares_keys: bool = False
    reads_values: bool = False

    @property
    def fits_budget(self) -> bool:
        """A budget is mapped to the scorer's own settings (``Scorer.sized``)."""
        return bool(self.fitted_fields)


BudgetRule = Callable[[int], int]


@dataclass(frozen=True)
class Defaults:
    """A scorer's schedule when the user sets none (``Policy``'s fields of the same names).

    sinks : int
        First positions never evicted.
    recent : int | (budget -> int)
        Recent positions never evicted, or a rule from the budget (H2O: budget // 2; may refuse it).
    interval : int | (budget -> int)
        Decode steps between compressions: a number (capped, ``interval_for``) or the method's
        own rule, used as it returns (LazyEviction: W, refusing a budget below 2W).
    compress_prefill : bool
        Compress the prompt right after prefill when it exceeds the budget.
    protect_prompt, pin_prompt : bool
        Keep every prompt token outside the budget (each method file cites its value), or inside it.
    prefill_block : int
        m > 0: block-wise prefill eviction on by default, in blocks of m (CAOTE Sec. 4.1: 128).
    recent_doc, interval_doc : str
        How ``recent`` and ``interval`` depend on the settings, for ``kvsieve methods``.
    """

    sinks: int = 0
    recent: int | BudgetRule = 0
    interval: int | BudgetRule = 1
    compress_prefill: bool = True
    protect_prompt: bool = False
    pin_prompt: bool = False
    prefill_block: int = 0
    recent_doc: str = ""
    interval_doc: str = ""

    def recent_for(self, budget: int | None) -> int:
        """The recent window at ``budget``."""
        return self.recent(budget) if callable(self.recent) else self.recent

    def interval_for(self, budget: int | None, uses_budget: bool = True) -> int:
        """Decode steps between compressions at ``budget``: the method's rule, or its number capped at
        ``budget // 2`` (at least 1) for a budgeted scorer, so that a budget stays a bound: the cache
        peaks at budget + interval <= 1.5 x budget (issue 28, see ``Policy``)."""
        if callable(self.interval):
            return self.interval(budget)
        return self.interval if budget is None or not uses_budget else max(1, min(self.interval, int(budget) // 2))

    def describe(self) -> dict[str, Any]:
        """sinks, recent, interval and protect_prompt as ``kvsieve methods`` lists them."""
        recent = self.recent_doc or (self.recent if not callable(self.recent) else "budget rule")
        interval = self.interval_doc or (self.interval if not callable(self.interval) else "budget rule")
        return {"sinks": self.sinks, "recent": recent, "interval": interval, "protect_prompt": self.protect_prompt,
                "pin_prompt": self.pin_prompt}


@dataclass
class Scorer:
    """Base class of every scoring method.

    Its whole contract with the engine: ``needs`` (what it reads and when, a ``Needs``),
    ``defaults`` (its schedule, a ``Defaults``), ``about`` (what ``kvsieve methods`` prints) and
    the hooks below, which get a layer as ``kvsieve.engine.LayerReader`` (read-only but for
    the scorer's own ``Needs.meta`` fields).  Dataclass fields are the method's hyperparameters;
    needs or defaults that depend on them are set in ``__post_init__`` (``dataclasses.replace``).
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

    def observe(self, layer, probs: torch.Tensor, query_pos: torch.Tensor, steps: bool = False) -> torch.Tensor | None:
        """Update per-token state from this step's attention rows [B, H_kv, G, T, capacity]
        (zero rows for padding queries); ``query_pos`` [B, T] are the queries' positions: one
        pass's (a prefill chunk when T > 1), or with ``steps`` T decode steps (``Needs.observes_steps``).
        May return weights [B, H_kv, R, capacity] whose mixes of V the attention pass computes
        alongside its output (``layer.step_results["value_mix"]``, see ``attention.Observer``)."""

    def score(self, layer, seen_tokens: torch.Tensor) -> torch.Tensor:
        """[B, H_kv, capacity] importance of each slot (dead slots may hold anything)."""
        raise NotImplementedError

    def select(self, layer, scores: torch.Tensor, budget: int | None, seen_tokens: torch.Tensor):
        """Optional own selection: return ``(keep_mask [B, H_kv, capacity], K or None)`` to
        bypass the allocator (methods whose kept count is not a budget, e.g. LagKV's
        partitions), or ``None`` to let the allocator choose.  With ``protect_prompt``
        ``budget`` is a [B, 1] tensor, each row's prompt length + budget (``row_budget``), and
        the prompt tokens score +inf like the other protected tokens."""
        return None

    def should_compress(self, layer, budget: int | None) -> bool:
        """Host-side decision (no device read) whether this layer compresses now."""
        return budget is not None and layer.max_len > budget

    def sized(self, horizon: int, feed: "Feed", budget: int | None = None) -> tuple["Scorer", int | None]:
        """For a scorer that sizes its own cache (LagKV's partitions): the scorer to run for rows
        of at most ``horizon`` tokens fed as ``feed`` says (with ``budget``: a copy whose
        ``needs.fitted_fields`` keep at most that many tokens per row), and the most tokens per kv
        head it holds in a layer it compresses, the prompt's wait for its first check apart (None:
        only the horizon bounds it); the store never allocates past it."""
        if budget is not None:
            raise NotImplementedError(f"{self.name} has no budget-to-settings rule")
        return self, None


def check_choice(value, allowed, what: str) -> None:
    """Raise a ValueError naming the allowed values (for scorer ``__post_init__`` checks)."""
    if value not in allowed:
        raise ValueError(f"{what} must be one of {list(allowed)}, got {value!r}")


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
        First ``sinks`` and last ``recent`` positions of each row are never evicted (``None``:
        the scorer's default).
    interval : int | None
        Compress every ``interval`` decode steps (the cache peaks at budget + interval).
        ``None`` takes the scorer's default (``Defaults.interval_for``), capped at ``budget // 2``
        for a budgeted scorer so the cache peaks at 1.5 x budget at most (issue 28: AMS's 512 at
        budget 128 would never compress); ``lazy``'s W (Alg. 1) refuses a budget below 2W
        instead.  An explicit interval is kept as given.
    compress_prefill : bool | None
        Compress the prompt right after prefill when it exceeds the budget; ``None`` takes
        the scorer's default (``Defaults.compress_prefill``).
    protect_prompt : bool | None
        True: each row's prompt tokens are never evicted and do not count against the budget, so
        a layer keeps ``prompt_len[row] + budget`` tokens per head and row.  False: prompt and
        generated tokens compete for one budget.  ``None``: ``Defaults.protect_prompt`` (its
        paper's reading).  Needs a budgeted method (LagKV's partitions refuse it).
    pin_prompt : bool | None
        True: the prompt stays but counts inside the budget; generated tokens compete for
        ``budget - prompt_len[row]`` slots, and a longer prompt keeps its first ``budget`` tokens
        (TriAttention's runner, ``count_prompt_tokens=True``: its compute_keep_indices).  Not with
        ``protect_prompt`` or a ragged allocator.  ``None``: ``Defaults.pin_prompt``.
    prefill_block : bool | int | None
        Read the prompt in blocks and compress after each one (block-wise prefill eviction,
        CAOTE Sec. 2 Eqs. 3-7), whatever ``GenerateConfig.prefill_chunk`` says.  ``True``: blocks
        of ``Defaults.prefill_block`` if the scorer sets one, else ``PREFILL_BLOCK`` (128, CAOTE
        Sec. 4.1, as the paper's bases in Table 10); an integer: blocks of that many tokens.
        ``None``: the scorer's default (on for CAOTE).
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
    pin_prompt: bool | None = None

    def __post_init__(self):
        check_fields(self)  # every later check may assume the annotated types
        defaults = self.scorer.defaults if self.scorer is not None else Defaults()
        if self.compress_prefill is None:
            self.compress_prefill = defaults.compress_prefill
        if self.protect_prompt is None:
            self.protect_prompt = defaults.protect_prompt and not self.pin_prompt
        if self.pin_prompt is None:
            self.pin_prompt = defaults.pin_prompt and not self.protect_prompt
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
        kept = "protect_prompt" if self.protect_prompt else "pin_prompt" if self.pin_prompt else None
        if kept and not needs.uses_budget:
            raise ValueError(f"{self.scorer.name} keeps tokens by its own rule (partitions), not by a budget, so its "
                             f"prompt cannot be set apart from the budget; drop {kept} (set it false)")
        if self.pin_prompt and self.protect_prompt:
            raise ValueError("protect_prompt keeps the prompt outside the budget, pin_prompt inside: set one false")
        if self.pin_prompt and self.allocator.ragged_heads:
            raise ValueError(f"pin_prompt keeps the prompt in every head, which allocator {self.allocator.name!r} "
                             "cannot count; use the uniform or pyramid allocator")
        if needs.cross_layer:
            self._check_cross_layer()
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

    def _check_cross_layer(self) -> None:
        """``Needs.cross_layer``: every layer must hold the same tokens (one budget, whole prompt)."""
        reasons = [reason for reason, applies in {
            f"allocator {self.allocator.name!r} gives layers or heads different budgets; use the uniform allocator":
                self.allocator.ragged_heads or not self.allocator.same_layer_budgets,
            "block-wise prefill compresses while layers differ; set prefill_block false": self.prefill_block,
            "it keeps some layers whole": self.scorer.needs.whole_layers}.items() if applies]
        if reasons:
            raise ValueError(f"{self.scorer.name} as set keeps the same tokens in every layer, but {reasons[0]}")

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
        if self.pin_prompt:  # only when set: settings recorded before pin_prompt existed stay equal
            out["pin_prompt"] = True
        out.update({f.name: getattr(self.scorer, f.name) for f in dataclasses.fields(self.scorer) if f.init})
        out.update({f"allocator_{f.name}": getattr(self.allocator, f.name) for f in dataclasses.fields(self.allocator)})
        return out
