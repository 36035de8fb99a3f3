"""Random eviction: the control every method must beat.

No paper and no official code: kvsieve's control baseline.
"""

import contextlib
from dataclasses import dataclass, field

import torch

from ..policy import About, Needs, Scorer, register


@register("random")
@dataclass
class RandomScorer(Scorer):
    """Uniformly random scores.

    Parameters
    ----------
    seed : int, default 0
        Seed of the scorer's own generator (kvsieve's choice), so runs are repeatable: each
        generate call draws from it afresh, so one policy used twice decodes the same tokens.
    """

    about = About("uniform random scores (control)", "control baseline; no paper")
    # per-token scores: the engine may evict in place; the generator cannot be traced
    # (torch._dynamo: "Failed to convert args/kwargs to proxy"), so compile=True decodes eagerly
    needs = Needs(slot_order_free=True, traceable=False)
    seed: int = 0
    _gen: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)

    @contextlib.contextmanager
    def attach(self, model, tokenizer):
        self._gen = None  # this call's first score seeds a new generator
        yield None

    def score(self, layer, seen_tokens):
        if self._gen is None or self._gen.device != layer.keys.device:
            self._gen = torch.Generator(device=layer.keys.device).manual_seed(self.seed)
        return torch.rand(layer.keys.shape[:3], generator=self._gen, device=layer.keys.device)
