"""Shared base of the ``<prefix>:<base>`` methods (``caote:``, ``fastcaote:``, ``ams:``)."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field

from ..policy import Scorer

BASE_SETTINGS = "base"  # the wrapper field that reports the base scorer's settings


def scorer_settings(scorer: Scorer) -> dict:
    """A scorer's hyperparameters (its init fields) by name, as ``Policy.settings`` lists them;
    a wrapped base's own ``base`` entry nests the same way (``ams:caote:tova``)."""
    return {f.name: getattr(scorer, f.name) for f in dataclasses.fields(scorer) if f.init}


@dataclass
class WrappingScorer(Scorer):
    """A scorer around a base scorer (``self.inner``) that forwards the engine's per-call and
    per-step hooks to it; subclasses change how scores are made from the base's.

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

    def wrap(self, prefix: str, inner: Scorer | None, example: str) -> None:
        """Check the base scorer ``inner``, record its settings in ``base`` and take over what the
        engine reads from it (per-token state, observing)."""
        if inner is None:
            raise ValueError(f"{prefix} needs a base method: use '{prefix}:<base>', e.g. {prefix}:{example}")
        if not inner.uses_budget:
            raise ValueError(f"{prefix} needs a budgeted base; {inner.name!r} sets its own cache size")
        if self.base:
            raise ValueError(f"{prefix}: {BASE_SETTINGS!r} reports the base method's settings and cannot be set; "
                             f"pass the base's settings by name (e.g. {prefix}:snapkv with window=32)")
        self.inner = inner
        self.base = scorer_settings(inner)
        self.name = f"{prefix}:{inner.name}"
        self.meta_init, self.kv_fields, self.observes = inner.meta_init, inner.kv_fields, inner.observes
        self.kv_sums = inner.kv_sums
        self.observes_last_only = inner.observes_last_only
        self.per_token_hook = inner.per_token_hook

    def attach(self, model, tokenizer):
        """The base's per-call hook (SkipKV's sentence table and hidden-state read): a wrapper
        needs none of its own, but without this a base that sets up in ``attach`` would run blind."""
        return self.inner.attach(model, tokenizer)

    def before_select_rows(self, keep):
        self.inner.before_select_rows(keep)

    def observe(self, layer, probs, query_pos):
        return self.inner.observe(layer, probs, query_pos)

    def should_compress(self, layer, budget):
        return self.inner.should_compress(layer, budget)

    def compresses_layer(self, layer_idx):
        return self.inner.compresses_layer(layer_idx)
