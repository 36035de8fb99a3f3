"""Shared base of the ``<prefix>:<base>`` methods (``caote:``, ``fastcaote:``, ``ams:``)."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import ClassVar

from ..policy import Scorer

BASE_SETTINGS = "base"  # the wrapper field that reports the base scorer's settings


def scorer_settings(scorer: Scorer) -> dict:
    """A scorer's hyperparameters (its init fields) by name, as ``Policy.settings`` lists them;
    a wrapped base's own ``base`` entry nests the same way (``ams:caote:tova``)."""
    return {f.name: getattr(scorer, f.name) for f in dataclasses.fields(scorer) if f.init}


@dataclass
class WrappingScorer(Scorer):
    """A scorer around a base scorer (``self.inner``); subclasses change how scores are made
    from the base's.

    The engine reads a scorer's ``needs`` and ``defaults`` only, and a wrapper's are built from
    its base's (``dataclasses.replace``): what a wrapper does not change is the base's.  Every hook
    of the ``Scorer`` contract reaches the base here unless a subclass overrides it
    (``tests/test_methods.py`` checks that none is left out).

    Parameters
    ----------
    inner : Scorer
        The base method's scorer (init only; kept as ``self.inner``).  ``make_policy`` builds it
        from every setting that is not the wrapper's own.
    base : dict
        Read-only: the base scorer's hyperparameters, filled at construction.  It is a dataclass
        field so that ``Policy.settings()`` (which lists the scorer's init fields) records them
        nested under ``"base"``, e.g. ``{"method": "caote:snapkv", ..., "base": {"window": 64,
        "kernel": 5, ...}}``: two runs of one wrapper over differently set bases never share a
        settings record.  Passing it is an error; set the base's settings by their own names.
    """

    inner: InitVar[Scorer | None] = None
    base: dict = field(default_factory=dict)
    # The wrapper's own schedule: ``Defaults`` fields that replace the base's (``kvsieve methods``
    # lists them as the wrapper's defaults).
    schedule: ClassVar[dict] = {}

    def wrap(self, prefix: str, inner: Scorer | None, example: str, **needs) -> None:
        """Check the base scorer ``inner``, record its settings in ``base``, and derive this
        wrapper's records from the base's: its ``needs`` with ``needs`` replaced, its defaults
        with ``schedule`` replaced."""
        if inner is None:
            raise ValueError(f"{prefix} needs a base method: use '{prefix}:<base>', e.g. {prefix}:{example}")
        if not inner.needs.uses_budget:
            raise ValueError(f"{prefix} needs a budgeted base; {inner.name!r} sets its own cache size")
        if inner.needs.cross_layer:  # a wrapper rescores one layer's tokens by that layer's own quantities
            raise ValueError(f"{prefix} rescores each layer on its own; {inner.name!r} with these settings keeps the "
                             "same tokens in every layer: choose a per-layer setting of it (triattention: "
                             "pruning=per_layer_per_head)")
        if self.base:
            raise ValueError(f"{prefix}: {BASE_SETTINGS!r} reports the base method's settings and cannot be set; "
                             f"pass the base's settings by name (e.g. {prefix}:snapkv with window=32)")
        self.inner = inner
        self.base = scorer_settings(inner)
        self.name = f"{prefix}:{inner.name}"
        self.needs = dataclasses.replace(inner.needs, **needs)
        self.defaults = dataclasses.replace(inner.defaults, **self.schedule)

    def attach(self, model, tokenizer):
        """The base's per-call hook (SkipKV's sentence table and hidden-state read): a wrapper
        needs none of its own, but without it a base that sets up in ``attach`` would run blind."""
        return self.inner.attach(model, tokenizer)

    def observe(self, layer, probs, query_pos, steps=False):
        return self.inner.observe(layer, probs, query_pos, steps)

    def score(self, layer, seen_tokens):
        return self.inner.score(layer, seen_tokens)

    def select(self, layer, scores, budget, seen_tokens):
        return self.inner.select(layer, scores, budget, seen_tokens)

    def should_compress(self, layer, budget):
        return self.inner.should_compress(layer, budget)

    def sized(self, horizon, feed, budget=None):
        """The base's peak; a wrapper needs a budgeted base, which never fits its own settings."""
        if budget is not None:
            raise NotImplementedError(f"{self.name} has no budget-to-settings rule")
        return self, self.inner.sized(horizon, feed)[1]
