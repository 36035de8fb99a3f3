"""Knorm: keep the keys with the smallest L2 norm.

Based on Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression" (arXiv:2406.11430): low key norm correlates with high attention, so the score is
the negated norm of the post-RoPE key. Attention-free; no hyperparameters.
"""

from dataclasses import dataclass

from ..cache import kv_field
from ..policy import Scorer, register


@register("knorm")
@dataclass
class Knorm(Scorer):
    summary = "negated L2 norm of each key (attention-free)"
    slot_order_free = True  # per-token scores: the engine may evict in place
    source = "Devoto et al. 2024 (arXiv:2406.11430), Sec. 3"
    kv_fields = ("key_norm",)

    def score(self, layer, seen_tokens):
        return -kv_field(layer, "key_norm")  # [B, H_kv, cap], computed once per token as it is appended
