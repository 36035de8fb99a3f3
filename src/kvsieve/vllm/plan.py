"""What kvsieve's vLLM scheduler tells its worker each step, and the rule that decides it.
Plain Python: no vLLM import.

Two lengths per request, kept apart (docs/vllm-design.md, "Two lengths"):

* the **logical length**: vLLM's ``num_computed_tokens``, the positions.  RoPE positions, the input
  token ids and every scheduler decision (prefill done? max_model_len?) keep using it unchanged;
* the **KV length**: tokens held in the request's blocks, ``logical - offset``.  Slot mapping,
  attention lengths and block allocation use it.

The scheduler owns ``offset`` per request and sends it with every step it schedules the request;
the worker keeps no offset of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..checks import SettingError, check_at_least, check_value, did_you_mean

# Methods served inside vLLM, through kvsieve's own scorers and schedule (``schedule.keep_set``):
# every (layer, kv head) of a request keeps the same count, fixed by the scheduler before any score
# is computed (one block table per request: AMS Appendix E).  "full" runs every kvsieve class with
# no eviction (the exactness baseline).  Wrappers: ``ams:<base>`` and ``ams-released:<base>`` over
# a served base.
#
# The count is the budget (+ the prompt with ``protect_prompt``), or for a scorer without a budget
# that declares a count rule (``Needs.count_rule``: the partitions of LagKV, LocalKV and lagkv-l2)
# that rule of the request's length: LagKV's Eq. (10), the count every check of kvsieve's schedule
# leaves, whatever the earlier checks were.  The scheduler keeps no state for it beyond the offset
# it has anyway (offset = frozen partitions x (L - k)).  With a budget, L and r are fitted once per
# server to ``horizon`` (the longest request; max_model_len by default), as kvsieve's engine fits
# them to a batch's horizon (``schedule.fitted``).
#
# Scorers that observe every query's attention (H2O's sums, LazyEviction's and RaaS's timestamps)
# have their state rebuilt at each compaction from every query since the last one, the prompt's
# included, so their ring holds ``max_model_len`` queries per request (``query_window``), at most the
# pool's tokens (the worker's ``initialize_kv_cache``: a replay reads only queries of tokens held).
#
# Block-wise prefill eviction (``prefill_block``: CAOTE and FastCAOTE by default, Sec. 2) is
# served at the boundaries of vLLM's prefill chunks: ``engine_kwargs`` sets vLLM's
# ``long_prefill_token_threshold`` to the block (128), which vLLM applies while more than one
# request is scheduled, and the scheduler compresses a prompt to its count before each chunk.  The
# output each CAOTE error is measured from (h V, or the mean value) is computed at compaction from
# the gathered values, where kvsieve's engine takes it from the attention pass
# (``step_results["value_mix"]``, the same quantity).
#
# SkipKV's sentences (``Needs.sentences``), which kvsieve's loop feeds through a per-token host hook
# (``SkipKV.attach``), are fed by the worker from every forward: each request's token ids, positions
# and the model's output, the final norm's (``sentences.RequestSentences``); before a batch is
# scored its requests' rows are selected (``store.compress_requests``' ``before_scoring``).
#
# Not served, and why (``unserved`` gives the same reason for any method and settings):
#
# * a per-token host hook other than SkipKV's sentence table: kvsieve's loop only;
# * SkipKV's adaptive steering (``kvsieve.steering``, ``STEERING``): it edits a decoder layer's input
#   inside the model's forward;
# * knorm and lagkv-l2 with their default skip_layers=2: two whole layers cannot share a block
#   table with compressed ones; served with skip_layers=0;
# * LagKV's chunked prefill (prefill_block, Sec. 3.4): its count rule over the prompt's blocks is
#   not served;
# * the pyramid and adakv allocators (per-layer and per-head counts): not offered.
SERVED = ("full", "streaming", "knorm", "keydiff", "random", "expected", "triattention", "snapkv", "rkv", "tova",
          "h2o", "lazy", "raas", "lagkv", "localkv", "lagkv-l2", "skipkv")
SERVED_WRAPPERS = ("ams", "ams-released", "caote", "fastcaote")
STEERING = ("SkipKV's adaptive steering (Sec. 4.2) is not served inside vLLM: it adds a vector to a decoder layer's "
            "input inside the model's forward, which kvsieve leaves as vLLM runs it; steer with kvsieve generate or "
            "kvsieve eval (--steering)")

# Per-request settings: flat keys of a request's ``SamplingParams.extra_args`` (which the OpenAI
# server fills from the request body's ``vllm_xargs``, whose values are flat), each the
# ``SieveSettings`` field it overrides and its least value.  The method, its options and query
# recording stay the server's.  Absent keys: the server's settings.
REQUEST_PREFIX = "kvsieve_"
REQUEST_KEYS = {"kvsieve_budget": ("budget", 1), "kvsieve_interval": ("interval", 1),
                "kvsieve_sinks": ("sinks", 0), "kvsieve_recent": ("recent", 0)}


def prefill_chunk(config: dict[str, Any]) -> int | None:
    """The block a method of ``config`` (a server's ``additional_config["kvsieve"]``) evicts the
    prompt by (``Policy.prefill_block_size``), or None; None too for settings ``from_config``
    refuses (the scheduler refuses them in one line)."""
    try:
        settings = SieveSettings.from_config(config)
    except ValueError:
        return None
    return settings.policy.prefill_block_size() if settings.compresses else None


def request_overrides(extra_args: dict[str, Any] | None) -> dict[str, int]:
    """The ``SieveSettings`` fields a request sets through its ``kvsieve_*`` keys of ``extra_args``
    (other keys are not kvsieve's and are left alone), or ``ValueError`` in one line naming the fix
    for an unknown ``kvsieve_*`` key or a value that is not an integer in range.  Only what needs no
    server is checked here (``SieveRequestCheck.validate_params`` runs it before the request is
    queued); whether the values fit the server's method is ``SieveSettings.for_request``'s."""
    overrides = {}
    for key, value in (extra_args or {}).items():
        if not isinstance(key, str) or not key.startswith(REQUEST_PREFIX):
            continue
        if key not in REQUEST_KEYS:
            raise ValueError(f"kvsieve: unknown per-request setting {key!r}{did_you_mean(key, REQUEST_KEYS)}; "
                             f"known: {', '.join(REQUEST_KEYS)} (the method and its options are the server's)")
        name, least = REQUEST_KEYS[key]
        try:
            check_value(key, value, int)
            check_at_least(key, value, least)
        except SettingError as err:
            raise ValueError(f"kvsieve: {err.in_terms(key)}") from None
        overrides[name] = int(value)
    return overrides


def request_settings(server: "SieveSettings", extra_args: dict[str, Any] | None,
                     max_model_len: int) -> tuple[dict[str, int], "SieveSettings"]:
    """A request's ``kvsieve_*`` overrides and the settings it runs with on a server of ``server``
    settings, or ``ValueError`` in one line naming the fix: a key or type that is wrong
    (``request_overrides``), values that do not fit the method (``SieveSettings.for_request``), or
    settings that need more recorded queries than the server's workers record.  One check in two
    places: the HTTP gate answers it with a 400 before vLLM reads the request (``request_gate``), the
    scheduler finishes a request that reaches it another way (``SieveScheduler.add_request``)."""
    overrides = request_overrides(extra_args)
    settings = server.for_request(overrides)
    # the worker's rings are sized for the server's settings (no served key changes them now)
    window, ring = settings.query_window(max_model_len), server.query_window(max_model_len)
    if window > ring:
        raise ValueError(f"kvsieve: these settings need {window} recorded queries per layer, more than the "
                         f"server records ({ring})")
    return overrides, settings


def settings_of(vllm_config) -> "SieveSettings":
    """A server's settings from its vLLM config (the scheduler's, the worker's and the HTTP
    gate's alike), a budget-fitting method's ``horizon`` the model's ``max_model_len`` unless set:
    no request runs longer."""
    from . import CONFIG_KEY

    extra = vllm_config.additional_config
    config = dict((extra.get(CONFIG_KEY) if isinstance(extra, dict) else None) or {})
    if config.get("horizon") is None:
        config["horizon"] = vllm_config.model_config.max_model_len
    return SieveSettings.from_config(config)


def unsplit(policy) -> str | None:
    """Why ``policy`` cannot run with its kv heads split over tensor-parallel workers, in one
    phrase, or None.  Each worker compacts only the kv heads it holds, with the count the scheduler
    planned, so a method whose scores are each kv head's own keeps what one worker keeps.  One that
    combines a layer's kv heads slot by slot (``Needs.aligned_heads``) has the workers combine
    their parts, where that is one reduction (``Needs.heads_combined_by``: TOVA's
    ``heads="layer"`` mean, TriAttention's ``per_layer`` max; ``store.heads_combiner``); any other
    would keep other tokens on each worker, and is refused.  (TriAttention's other
    modes read statistics of every head: each worker cuts them to its own, ``TriAttention.for_heads``.)"""
    scorer = policy.scorer
    if scorer is None:
        return None
    if scorer.needs.aligned_heads and not scorer.needs.heads_combined_by:
        return "its scores combine every kv head of a layer in a way tensor-parallel workers, which hold them " \
               "apart, cannot rebuild from their parts (CAOTE's errors over an aligned base: choose a base " \
               "scored per kv head, e.g. tova with heads=group)"
    return None


def unserved(policy) -> str | None:
    """Why kvsieve's vLLM integration cannot serve ``policy`` (a ``kvsieve.policy.Policy``), in one
    phrase, or None when it can: every (layer, kv head) must keep one count the scheduler knows
    before the step (the budget, or the scorer's own ``Needs.count_rule``), and a scorer's state must be
    rebuildable from the KV and the recorded queries."""
    scorer = policy.scorer
    if scorer is None:
        return None
    needs = scorer.needs
    if not needs.uses_budget and needs.count_rule is None:
        return "its own rule decides how many tokens stay at compaction time, and the scheduler must know the " \
               "count before the step"
    if needs.whole_layers:
        return f"it keeps its first {needs.whole_layers} layers whole, which cannot share one block table with " \
               "compressed layers (set skip_layers=0)"
    if needs.per_token_hook and not needs.sentences:  # SkipKV's sentences: the worker feeds them
        return "it needs a per-token host hook (kvsieve's own decode loop only)"
    if policy.prefill_block_size() is not None and not needs.uses_budget:
        return "its own count rule over the prompt's blocks (prefill_block) is not served; set prefill_block=false " \
               "to compress the prompt once after prefill"
    if policy.allocator.ragged_heads or policy.allocator.name != "uniform":
        return f"allocator {policy.allocator.name!r} gives layers or heads different counts"
    return None


@dataclass(frozen=True)
class SieveSettings:
    """Server-wide settings, from ``additional_config["kvsieve"]`` (``kvsieve.vllm.engine_kwargs``).

    ``method``, ``budget`` and the schedule fields mean what they mean in ``kvsieve.make_policy``
    (None: the method's default); ``options``: the method's own settings (``make_policy``'s other
    keywords, e.g. ``{"skip_layers": 0}``, ``{"stats": FILE}``); ``record_queries``: at least this
    many recent queries per (request, layer) recorded, beyond what the method asks for; ``horizon``:
    the longest request (prompt + output tokens) a budget is fitted to by a method that maps it to
    its own settings (``Needs.fits_budget``: LagKV's L and r, ``fit_budget``), the server's
    ``max_model_len`` when unset (``settings_of``); no other method reads it."""

    method: str = "full"
    budget: int | None = None
    sinks: int | None = None
    recent: int | None = None
    interval: int | None = None
    compress_prefill: bool | None = None
    protect_prompt: bool | None = None
    pin_prompt: bool | None = None
    record_queries: int = 0
    horizon: int | None = None
    options: dict = field(default_factory=dict, hash=False)

    SCHEDULE = ("sinks", "recent", "interval", "compress_prefill", "protect_prompt", "pin_prompt")

    @classmethod
    def from_config(cls, config: dict[str, Any] | None, named: dict[str, str] | None = None) -> "SieveSettings":
        """The settings, or a ValueError in one line (unknown key, method not served, bad value);
        ``named``: how the caller names a setting in that line (a request's ``kvsieve_budget``),
        where it is not its keyword (``budget=``)."""
        config = dict(config or {})
        unknown = set(config) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"kvsieve: unknown vLLM setting(s) {sorted(unknown)}; known: "
                             f"{sorted(cls.__dataclass_fields__)}")
        settings = cls(**{k: v for k, v in config.items() if v is not None})
        if not isinstance(settings.record_queries, int) or isinstance(settings.record_queries, bool) \
                or settings.record_queries < 0:
            raise ValueError(f"kvsieve: record_queries must be an integer >= 0, got {settings.record_queries!r}")
        if settings.horizon is not None and (not isinstance(settings.horizon, int) or isinstance(settings.horizon, bool)
                                             or settings.horizon < 1):
            raise ValueError(f"kvsieve: horizon must be an integer >= 1, got {settings.horizon!r}")
        if not isinstance(settings.options, dict):
            raise ValueError(f"kvsieve: options must be a mapping of the method's settings, got {settings.options!r}")
        if "steering" in settings.options:
            raise ValueError(f"kvsieve: {STEERING}")
        try:
            policy = settings.policy
        except (TypeError, ValueError) as err:
            if isinstance(err, SettingError) and err.setting in (named or {}):
                err = ValueError(err.in_terms(named[err.setting]))
            reason, method = " ".join(str(err).split()), f"{settings.method}: "
            raise ValueError(f"kvsieve: {reason if reason.startswith(method) else method + reason}") from None
        why = unserved(policy)
        if why:
            raise ValueError(f"kvsieve: {settings.method} with these settings is not served inside vLLM: {why}")
        base = settings.method.split(":", 1)[-1]
        wrapper = settings.method.split(":", 1)[0] if ":" in settings.method else None
        if base not in SERVED or (wrapper is not None and wrapper not in SERVED_WRAPPERS):
            raise ValueError(f"kvsieve: method {settings.method!r} is not served inside vLLM yet; served: "
                             f"{', '.join(SERVED)}, and {', '.join(w + ':<base>' for w in SERVED_WRAPPERS)}")
        return settings

    def for_request(self, overrides: dict[str, int]) -> "SieveSettings":
        """These settings with a request's ``overrides`` (``request_overrides``), checked as the
        server's own are (``from_config``): the same settings a server started with them would
        have, so the request keeps and scores exactly as such a server's requests.  ``ValueError``
        in one line, naming the request's keys, when they do not fit (a budget below the method's
        protected tokens, a budget LagKV cannot fit at ``horizon``, any key on a ``full`` server)."""
        if not overrides:
            return self
        keys = {name: key for key, (name, _) in REQUEST_KEYS.items()}
        given = ", ".join(f"{keys[name]}={value}" for name, value in overrides.items())
        if not self.compresses:
            raise ValueError(f"kvsieve: this server evicts nothing (method full), so the request's {given} cannot "
                             "apply; drop it, or serve a method")
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return SieveSettings.from_config({**current, **overrides}, named=keys)

    @cached_property
    def policy(self):
        """The ``kvsieve.policy.Policy`` these settings name (its defaults filled in by the method),
        with a budget-fitting method's settings fitted to ``horizon`` when it is set
        (``schedule.fitted``, as kvsieve's engine does for a batch of that horizon)."""
        from ..methods import make_policy
        from ..schedule import fitted

        schedule = {k: getattr(self, k) for k in self.SCHEDULE if getattr(self, k) is not None}
        if self.method == "full":
            return make_policy("full")
        policy = make_policy(self.method, self.budget, **schedule, **self.options)
        return policy if self.horizon is None else fitted(policy, self.horizon)

    @property
    def unfitted(self) -> bool:
        """A budget that the method maps to its own settings, not yet fitted (no ``horizon``)."""
        scorer = self.policy.scorer
        return scorer is not None and scorer.needs.fits_budget and self.budget is not None and self.horizon is None

    @property
    def compresses(self) -> bool:
        return self.method != "full"

    def for_model(self, hf_config) -> "SieveSettings":
        """These settings for the model of ``hf_config`` (its HF config).  In kvsieve's engine a
        scorer reads facts of the model in ``attach``, which vLLM's model cannot answer: Expected
        Attention's RoPE frequencies (the ``inv_freq`` buffer, which vLLM's rotary embedding does
        not keep) and the timestamp methods' alpha of the model's family (``family="auto"``,
        ``config.model_type``).  Unless set in ``options``, they are given here from the config:
        ``rope_theta`` of the model's standard RoPE (a scaled RoPE is refused) and ``family``."""
        import dataclasses

        from ..methods import SCORERS
        from ..methods._timestamps import ALPHA_BY_FAMILY, MODEL_FAMILY

        base = SCORERS.get(self.method.split(":", 1)[-1])
        fields = set() if base is None else {f.name for f in dataclasses.fields(base)}
        options = dict(self.options)
        if "rope_theta" in fields and "rope_theta" not in options:
            rope = dict(getattr(hf_config, "rope_parameters", None) or {})
            if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
                raise ValueError(f"kvsieve: {self.method} needs the model's RoPE base, and the model's RoPE is "
                                 f"{rope}; set options={{'rope_theta': BASE}} for standard RoPE")
            options["rope_theta"] = float(rope["rope_theta"])
        if "family" in fields and options.get("family", MODEL_FAMILY) == MODEL_FAMILY and options.get("alpha") is None:
            family = getattr(hf_config, "model_type", None)
            if family not in ALPHA_BY_FAMILY:
                raise ValueError(f"kvsieve: {self.method} takes its alpha from the model's family, and "
                                 f"{family!r} is none of {sorted(ALPHA_BY_FAMILY)}; set options={{'alpha': A}}")
            options["family"] = family
        return self if options == self.options else dataclasses.replace(self, options=options)

    def query_window(self, max_model_len: int = 0) -> int:
        """Recent queries per (request, layer) the worker records: what the scorer scores with
        (``Needs.query_window``; TOVA's last query), every query of a request (``max_model_len``)
        for a scorer that observes every query's attention (``store.observe_since``), and at
        least ``record_queries``."""
        scorer = self.policy.scorer
        if scorer is None:
            return self.record_queries
        needs = scorer.needs
        every = max_model_len if needs.observes and not needs.observes_last_only else 0
        return max(self.record_queries, needs.query_window, every, 1 if needs.observes else 0)


def count_of(settings: SieveSettings, prompt_len: int, seen: int) -> int:
    """Tokens a request keeps at a compaction after ``seen`` tokens (prompt included): the budget,
    + the prompt with ``protect_prompt``, or the scorer's own count rule (checked in ``unserved``:
    LagKV's) of ``seen`` tokens."""
    policy = settings.policy
    if policy.scorer.needs.uses_budget:
        return policy.budget + (prompt_len if policy.protect_prompt else 0)
    return policy.scorer.needs.count_rule(seen)


def keep_count(settings: SieveSettings, kv_len: int, decode_steps: int, recomputed: bool = False,
               prompt_len: int = 0, block_size: int | None = None) -> int | None:
    """Tokens every (layer, kv head) of a request keeps when it is compressed now, or None when it
    is not.  Called by the scheduler before each step, for a request whose KV holds all its tokens
    but the last sampled one (its prompt done): ``kv_len`` tokens in its blocks, ``decode_steps``
    tokens generated into its KV since the prompt of ``prompt_len`` tokens.  The count is the
    budget (+ the prompt with ``protect_prompt``: ``Schedule.bound``), known here before any score
    is computed, so the scheduler frees the tail blocks itself and the worker only fills the kept
    slots.  When it is due:

    * after the prompt when ``compress_prefill`` (the prompt's surplus blocks go back at once);
    * ``recomputed``: the request was preempted and has just recomputed its prompt and outputs at
      full length, which an unpreempted request never holds: at once;
    * with an interval set (server or request): every ``interval`` decode steps while over the
      count, kvsieve's schedule (``schedule.Schedule``), as in the transformers engine;
    * with none set and the scheduler's ``block_size`` given, the serving default (``block_due``):
      when this step's token would need a new block, once the request holds at least the
      method's own interval over the count.  Memory is taken a block at a time, so compacting
      earlier frees nothing; a request holds at most one block above its count (budget <= its
      blocks' tokens < budget + block_size for methods whose interval is below a block).

    A scorer without a budget that declares a count rule (``Needs.count_rule``, LagKV) keeps that
    rule's count of the request's ``prompt_len + decode_steps`` tokens seen instead, on the same
    schedule: what its ``select`` keeps at that check in kvsieve's engine."""
    if not settings.compresses:
        return None
    if settings.unfitted:
        raise ValueError(f"kvsieve: {settings.method} fits its settings to the budget at a horizon: set horizon "
                         "(the server sets max_model_len)")
    policy = settings.policy
    bound = count_of(settings, prompt_len, prompt_len + decode_steps)
    if kv_len <= bound:
        return None
    if recomputed or (decode_steps == 0 and policy.compress_prefill):
        return bound
    if decode_steps == 0:
        return None
    if settings.interval is None and block_size:
        due = block_due(kv_len, bound, policy.interval, block_size)
    else:
        due = decode_steps % policy.interval == 0
    return bound if due else None


def block_due(kv_len: int, bound: int, interval: int, block_size: int) -> bool:
    """The serving default's rule: a request of ``kv_len`` tokens over its count ``bound`` is
    compacted when the token it writes next opens a new block (``kv_len`` a multiple of
    ``block_size``) and it holds at least the method's ``interval`` tokens over the count.  For
    an interval up to a block (StreamingLLM, TOVA, H2O: 1) that is every block's worth of tokens,
    and the request never asks the pool for a block above ``ceil((bound + 1) / block_size)``;
    a longer interval (AMS and Expected Attention's 512, capped at budget / 2) is kept, rounded
    up to the next block."""
    return kv_len % block_size == 0 and kv_len - bound >= interval


@dataclass(frozen=True)
class Compaction:
    """Compress one request before this step's forward pass.

    ``block_ids``: the request's blocks (KV cache group 0) before compaction, which hold its
    ``kv_len`` tokens; ``keep``: tokens each (layer, kv head) keeps, moved into the request's
    first slots; ``kept_blocks``: the blocks it keeps, enough for ``keep`` tokens and the token
    this step writes (the cut tail's first block serves it: the worker reads the old tokens out
    before the forward pass writes the new one, so no block is allocated while the cut ones are
    still held).  The scheduler has already cut the request's block list to ``kept_blocks`` and
    frees the rest once this step has run.  ``logical_len``: the request's ``num_computed_tokens``
    (its positions run 0 .. logical_len - 1); ``prompt_len``: its prompt's tokens (a protected
    prompt is kept outside the budget); ``overrides``: the request's own settings
    (``request_overrides``; empty: the server's), so the worker scores with the policy the
    scheduler counted with (``SieveSettings.for_request``)."""

    req_id: str
    block_ids: tuple[int, ...]
    kv_len: int
    keep: int
    kept_blocks: int
    logical_len: int
    prompt_len: int = 0
    overrides: dict[str, int] = field(default_factory=dict, hash=False)


@dataclass
class SievePlan:
    """The scheduler's word for one step: compactions to apply before the forward pass, and the
    offset (logical - KV length) of every scheduled request that has one."""

    step: int
    compactions: list[Compaction] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)
