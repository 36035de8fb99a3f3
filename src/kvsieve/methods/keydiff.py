"""KeyDiff: keep keys that differ most from the average key.

arXiv:2504.15364; official code: none published (kvpress ports it as KeyDiffPress).

Based on Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments" (arXiv:2504.15364): the anchor is the mean of
the normalised keys, and a token's score is its negated cosine similarity to the anchor
(Sec. 3). Attention-free; no hyperparameters.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache import kv_field, kv_sum
from ..policy import About, Needs, Scorer, register


@register("keydiff")
@dataclass
class KeyDiff(Scorer):
    about = About("negated cosine similarity to the mean key (attention-free)",
                  "Park et al. 2025 (arXiv:2504.15364), Sec. 3")
    # per-token scores (the engine may evict in place); key norms per token, the anchor's running sum
    needs = Needs(kv_fields=("key_norm",), kv_sums=("unit_key_sum",), slot_order_free=True, stacks_layers=True)
    # Schedule: the engine's ``Defaults()`` (sinks 0, recent 0, interval 1, compress_prefill True), kvsieve's
    # choice, none cited from the paper: the cache is held at the budget from prefill on, step by step.
    # protect_prompt False: AMS App. B.2 caps its KeyDiff baseline's per-layer cache at T_keep, prompt
    # included (its Table 11 notes prompt-prefix protection for R-KV and RPC only); that comparison runs
    # decode-only every 512 tokens (``interval=512, compress_prefill=False``, as ``ams:``).

    def score(self, layer, seen_tokens):
        # one pass over the keys, no normalised copy: cos(k, a) = (k . a_hat) / |k|, with the key
        # norms computed once per token as it was appended, and the anchor's sum of live
        # normalised keys kept running by the cache (added at append, subtracted at eviction)
        keys = layer.keys.float()  # [B, H_kv, cap, D]
        inv_norm = 1.0 / kv_field(layer, "key_norm").clamp(min=1e-12)  # [B, H_kv, cap]
        anchor = F.normalize(kv_sum(layer, "unit_key_sum").float(), dim=-1)  # [B, H_kv, D]: its scale cancels
        # a row vector times K^T ([1, D] @ [D, cap]): on CPU about twice as fast as K @ a ([cap, D] @ [D, 1])
        return -(anchor[:, :, None, :] @ keys.transpose(-1, -2)).squeeze(2) * inv_norm
