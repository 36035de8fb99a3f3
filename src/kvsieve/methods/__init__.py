"""Registered methods. Importing this package registers every scorer in it.

``make_policy("tova", budget=128, recent=16)`` builds a ``Policy``: keyword settings go to
the scorer's dataclass fields, to the schedule (``sinks``, ``recent``, ``interval``,
``compress_prefill``, ``prefill_block``, ``protect_prompt``) or, prefixed ``allocator_``, to the allocator.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from ..allocators import ALLOCATORS, make_allocator
from ..checks import check_kwargs, check_value, did_you_mean
from ..policy import SCORERS, Policy, Scorer
from ._wrapper import BASE_SETTINGS

# Wrapper methods hold another method's scorer and are named "<prefix>:<base>" (``caote:tova``).
# Defined before _register_all so a method module can register its wrapper when imported.
WRAPPERS: dict[str, type] = {}


def register_wrapper(prefix: str):
    """Class decorator: ``<prefix>:<base>`` is ``cls(base scorer, **own settings)``, whose records
    derive from the base's (``WrappingScorer.wrap``; ``cls.schedule`` replaces the base's defaults)."""

    def add(cls):
        if prefix in WRAPPERS or prefix in SCORERS:
            raise ValueError(f"method wrapper {prefix!r} registered twice")
        WRAPPERS[prefix] = cls
        return cls

    return add


def _register_all() -> None:
    """Import every module of this package: each registers its scorer when imported."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_register_all()

SCHEDULE_FIELDS = ("sinks", "recent", "interval", "compress_prefill", "prefill_block", "protect_prompt", "pin_prompt")


def method_names() -> list[str]:
    return ["full", *sorted(SCORERS)]


def unknown_method(name: str) -> ValueError:
    """The error for a method name that is neither registered nor ``<wrapper>:<base>``: it suggests
    the nearest name and lists the methods and the wrappers (a bare wrapper name asks for its base)."""
    wrappers = ", ".join(f"{prefix}:<base>" for prefix in sorted(WRAPPERS))
    if name in WRAPPERS:
        return ValueError(f"method {name!r} wraps another method: name its base, e.g. {name}:tova ({name}:<base>)")
    return ValueError(f"unknown method {name!r}{did_you_mean(name, [*method_names(), *WRAPPERS])}; choose one "
                      f"of: {', '.join(method_names())}; or a wrapper: {wrappers}")


def _wrapper(name: str) -> tuple[type, str]:
    """``(wrapper class, base name)`` of ``"<prefix>:<base>"``, or an error naming the wrappers."""
    prefix, base = name.split(":", 1)
    if prefix not in WRAPPERS:
        raise ValueError(f"unknown method wrapper {prefix!r} in {name!r}{did_you_mean(prefix, WRAPPERS)}; "
                         f"wrappers: {', '.join(sorted(WRAPPERS))}")
    return WRAPPERS[prefix], base


def takes_budget(name: str) -> bool:
    """Whether method ``name`` runs at a token budget (``lagkv`` may: its budget is mapped to
    (L, r)); raises the same error as ``make_policy`` for an unknown name."""
    if name == "full":
        return False
    if ":" in name:
        return takes_budget(_wrapper(name)[1])
    if name not in SCORERS:
        raise unknown_method(name)
    needs = SCORERS[name].needs
    return needs.uses_budget or needs.fits_budget


def sizes_itself(name: str, settings: dict) -> bool:
    """Whether ``name`` under ``settings`` runs without a budget although it can take one: a
    method whose budget is mapped to its own settings (LagKV's L and r, ``Needs.fitted_fields``)
    keeps those settings when the user gives any of them, so a budget would have nothing to fit."""
    if not takes_budget(name) or ":" in name:
        return False
    needs = SCORERS[name].needs
    return not needs.uses_budget and any(key in needs.fitted_fields for key in settings)


def make_policy(name: str, budget: int | None = None, allocator: str = "uniform", **settings) -> Policy:
    """Build the policy called ``name``; errors name what is allowed, and a setting of the wrong
    type is refused by name before anything is built (``kvsieve.checks``)."""
    check_value("name", name, str)
    check_kwargs(Policy, {"budget": budget, **settings})
    if name == "full":
        return Policy(scorer=None)
    scorer = make_scorer(name, settings)  # takes the scorers' own settings out of ``settings``
    schedule_kw = {k: v for k, v in settings.items() if k in SCHEDULE_FIELDS}
    alloc_kw = {k[len("allocator_"):]: v for k, v in settings.items() if k.startswith("allocator_")}
    if allocator in ALLOCATORS:
        check_kwargs(ALLOCATORS[allocator], alloc_kw, prefix="allocator_")
    return Policy(scorer=scorer, budget=budget, allocator=make_allocator(allocator, **alloc_kw), **schedule_kw)


def make_scorer(name: str, settings: dict) -> Scorer:
    """The scorer called ``name``, built from (and taking out of ``settings``) its own settings.
    ``<prefix>:<base>``: the wrapper's own fields go to it, every other setting to the base, and
    the wrapper derives its records from the base's (``WrappingScorer.wrap``)."""
    if ":" in name:
        cls, base = _wrapper(name)
        own = {f.name for f in dataclasses.fields(cls) if f.init} - {BASE_SETTINGS}  # a report, never set
        wrapper_kw = {k: settings.pop(k) for k in list(settings) if k in own}
        check_kwargs(cls, wrapper_kw)
        return cls(make_scorer(base, settings), **wrapper_kw)
    if name not in SCORERS:
        raise unknown_method(name)
    cls = SCORERS[name]
    scorer_fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = {k for k in settings if k not in scorer_fields and k not in SCHEDULE_FIELDS
               and not k.startswith("allocator_")}
    if unknown:
        allowed = sorted(scorer_fields | set(SCHEDULE_FIELDS))
        raise ValueError(f"unknown setting(s) {sorted(unknown)} for {name!r}; allowed: {allowed} or allocator_*")
    own = {k: settings[k] if k in SCHEDULE_FIELDS else settings.pop(k) for k in list(settings) if k in scorer_fields}
    check_kwargs(cls, own)
    # a field named like a schedule setting (expected's and lagkv's ``sinks``) is shared with the policy
    return cls(**own)


def budget_semantics(uses_budget: bool, schedule: dict) -> str:
    """What a method's budget holds by default, for ``kvsieve methods``: the prompt's handling, the
    protected window and the sinks (``schedule``: ``Defaults`` fields, a wrapper's partial)."""
    if not uses_budget:
        return "no budget: its own settings size the cache; the prompt competes"
    if "protect_prompt" not in schedule:
        prompt = "the base's prompt handling"
    elif schedule["protect_prompt"]:
        prompt = "prompt kept outside the budget; the budget holds generated tokens"
    elif schedule.get("pin_prompt"):
        prompt = "prompt kept inside the budget; generated tokens get what the prompt leaves"
    elif schedule.get("compress_prefill", True):
        prompt = "prompt competes, compressed at prefill; the budget holds every token"
    else:
        prompt = "prompt competes from the first decode compression; the budget holds every token"
    recent = schedule.get("recent_doc") or schedule.get("recent")
    if recent == "window":
        recent = "its observation window (`window`)"
    window = f"; recent window: {recent}" if recent and not callable(recent) else ""
    sinks = f"; {schedule['sinks']} sinks" if schedule.get("sinks") else ""
    return prompt + window + sinks


def describe_methods() -> list[dict]:
    """One row per method: name, summary, hyperparameters with defaults, what its budget holds
    (``budget_semantics``), and the source of its defaults."""
    rows = [{"name": "full", "summary": "no eviction (reference)", "params": {}, "source": "-",
             "budget": "no budget: every token kept"}]
    for name in sorted(SCORERS):
        cls = SCORERS[name]
        params = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
        rows.append({"name": name, "summary": cls.about.summary, "params": {**params, **cls.defaults.describe()},
                     "source": cls.about.source,
                     "budget": budget_semantics(cls.needs.uses_budget, dataclasses.asdict(cls.defaults))})
    for prefix in sorted(WRAPPERS):
        cls = WRAPPERS[prefix]
        own = {f.name: f.default for f in dataclasses.fields(cls) if f.init and f.name != BASE_SETTINGS}
        schedule = {k: v for k, v in cls.schedule.items() if not k.endswith("_doc")}
        rows.append({"name": f"{prefix}:<base>", "summary": cls.about.summary, "params": {**own, **schedule},
                     "source": cls.about.source, "budget": budget_semantics(True, cls.schedule)})
    for name, cls in ALLOCATORS.items():
        params = {f.name: f.default for f in dataclasses.fields(cls)}
        rows.append({"name": f"allocator:{name}", "summary": cls.summary, "params": params, "source": cls.source})
    return rows
