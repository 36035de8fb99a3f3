"""KeyDiff: keep keys that differ most from the average key.

Based on Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments" (arXiv:2504.15364): the anchor is the mean of
the normalised keys, and a token's score is its negated cosine similarity to the anchor
(Sec. 3). Attention-free; no hyperparameters.
"""

from dataclasses import dataclass

import torch.nn.functional as F

from ..policy import Scorer, register


@register("keydiff")
@dataclass
class KeyDiff(Scorer):
    summary = "negated cosine similarity to the mean key (attention-free)"
    slot_order_free = True  # per-token scores: the engine may evict in place
    source = "Park et al. 2025 (arXiv:2504.15364), Sec. 3"

    def score(self, layer, seen_tokens):
        keys = F.normalize(layer.keys.float(), dim=-1)  # [B, H_kv, cap, D]
        live = layer.live()[..., None]  # [B, H_kv, cap, 1]
        anchor = (keys * live).sum(dim=2) / live.sum(dim=2).clamp(min=1)  # [B, H_kv, D]
        return -(keys @ F.normalize(anchor, dim=-1)[..., None]).squeeze(-1)
