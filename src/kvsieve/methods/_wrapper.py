"""Shared base of the ``<prefix>:<base>`` methods (``caote:``, ``fastcaote:``, ``ams:``)."""

from __future__ import annotations

from ..policy import Scorer


class WrappingScorer(Scorer):
    """A scorer around a base scorer (``self.inner``) that forwards the engine's per-call and
    per-step hooks to it; subclasses change how scores are made from the base's."""

    def wrap(self, prefix: str, base: Scorer | None, example: str) -> None:
        """Check ``base`` and take over what the engine reads from it (per-token state, observing)."""
        if base is None:
            raise ValueError(f"{prefix} needs a base method: use '{prefix}:<base>', e.g. {prefix}:{example}")
        if not base.uses_budget:
            raise ValueError(f"{prefix} needs a budgeted base; {base.name!r} sets its own cache size")
        self.inner = base
        self.name = f"{prefix}:{base.name}"
        self.meta_init, self.kv_fields, self.observes = base.meta_init, base.kv_fields, base.observes
        self.kv_sums = base.kv_sums
        self.observes_last_only = base.observes_last_only

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
