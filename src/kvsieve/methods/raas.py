"""RaaS: keep the prompt, evict the generated tokens least recently attended.

arXiv:2502.11147; official code: none published (run as LazyEviction's baseline).

Based on Hu et al., "Efficient Long-Decoding Inference with Reasoning-Aware Attention
Sparsity" (arXiv:2502.11147), as LazyEviction describes and runs it as a baseline (App. C,
App. H.2, Tables 1-3): every prefill token is retained (its "phoenix" tokens); each decode
token carries a timestamp, the last step its attention was at least alpha (the same TS as
LazyEviction's, ``_timestamps``), and the least recently stamped go first (timestamp LRU),
with a decision at every decode step.  A new token is stamped at its birth step.

The budget is a hard cap: prompt tokens outrank every decode token, so all of them stay
whenever the prompt fits.  A prompt longer than the budget is itself cut, least recently
attended first: the failure App. H.3 describes ("the budget becomes saturated by the prefill
tokens").  Table 3's "RaaS + window" is ``interval=W, recent=W``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..policy import About, Needs, Scorer, check_choice, register
from ._common import HEAD_REDUCTIONS
from ._timestamps import (MODEL_FAMILY, TS_UNSET, alpha_for_call, born_timestamps, observe_timestamps,
                          resolve_alpha, threshold)

# Decode tokens score TS - 2**23, prompt tokens TS: every prompt token ranks first, and
# integer stamps below 2**23 stay exact in float32.
_DECODE_OFFSET = 2.0**23


@register("raas")
@dataclass
class RaaS(Scorer):
    """Prompt kept, timestamp-LRU over decode tokens.

    Parameters
    ----------
    alpha : float | None, default None
        Attention threshold that refreshes a timestamp.  None: LazyEviction's Table 10 value
        for ``family`` (the paper adopts RaaS's way of setting alpha, Sec. 4, and gives no
        separate value for its RaaS runs).
    family : str, default "auto"
        Model family for alpha: "llama"/"mistral" 5e-4, "qwen2"/"qwen3" 1e-4 (see ``lazy``);
        "auto": the model's own (``config.model_type``), read at each generate call, as ``lazy``.
    head_reduction : str, default "mean"
        Reduction of a GQA group's attention onto its kv head, as in ``lazy``.
    """

    about = About("all prompt tokens + decode tokens by latest attention >= alpha (timestamp LRU)",
                  "Hu et al. 2025 (arXiv:2502.11147) as in LazyEviction App. C, H.2: every step; "
                  "alpha from LazyEviction Table 10 by family (extrapolated beyond DS-Llama/Qwen)")
    # new tokens: born now, not prompt; per-token scores: the engine may evict in place
    # observes_steps: T decode steps' rows in one call set TS as T calls do (observe_timestamps)
    needs = Needs(meta={"ts": TS_UNSET, "prompt": 0.0}, observes=True, observes_steps=True, slot_order_free=True,
                  stacks_layers=True)
    # protect_prompt False (inherited): RaaS keeps the prompt by its own rule, inside the budget (App. H.2:
    # it "mandatorily retain[s] all Prefill tokens"; H.3: "the KV cache budget becomes saturated by the
    # prefill tokens"), so the prompt is not put outside it

    alpha: float | None = None
    family: str = MODEL_FAMILY
    head_reduction: str = "mean"
    # the alpha of the generate call in progress (``attach``), when alpha follows the model's family
    call_alpha: float | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.alpha = resolve_alpha(self.alpha, self.family, "raas")
        check_choice(self.head_reduction, HEAD_REDUCTIONS, "raas head_reduction")

    def attach(self, model, tokenizer):
        """For one generate call: alpha from the model's family when ``family="auto"``."""
        return alpha_for_call(self, model)

    def observe(self, layer, probs, query_pos, steps=False):
        # probs: [B, H_kv, G, T, cap]; a multi-query call without ``steps`` is a prefill chunk, and
        # everything cached during prefill is prompt.  (A final prefill chunk of one token is taken
        # for a decode step: the engine does not say which phase it is in.)
        if probs.shape[3] > 1 and not steps:
            layer.meta["prompt"].copy_(layer.live())
        observe_timestamps(layer, probs, query_pos, threshold(self), self.head_reduction, track_mri=False)

    def score(self, layer, seen_tokens):
        ts = born_timestamps(layer)  # [B, H_kv, cap]
        return torch.where(layer.meta["prompt"] > 0, ts, ts - _DECODE_OFFSET)
