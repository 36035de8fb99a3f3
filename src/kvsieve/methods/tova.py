"""TOVA: token omission via attention.

Based on Oren et al., "Transformers are Multi-State RNNs" (arXiv:2401.06104).  At each step
the token with the lowest attention from the *current* query is dropped (Sec. 3.3); the
paper averages the attention over all heads of a layer, so all heads keep the same tokens.
"""

from dataclasses import dataclass

from ..attention import window_attention
from ..policy import Scorer, check_choice, reduce_group, register


@register("tova")
@dataclass
class TOVA(Scorer):
    """Last query's attention.

    Parameters
    ----------
    heads : str, default "layer"
        "layer": mean over all query heads of the layer (TOVA Sec. 3.3, the paper's choice);
        "group": mean over each kv head's query group, so kv heads keep different tokens.
    """

    summary = "attention of the current query, averaged over heads"
    slot_order_free = True  # per-token scores: the engine may evict in place
    source = "Oren et al. 2024 (arXiv:2401.06104), Sec. 3.3"
    heads: str = "layer"

    def __post_init__(self):
        check_choice(self.heads, ("layer", "group"), "tova heads")

    def query_window(self):
        return 1

    def needs_aligned_heads(self):
        return self.heads == "layer"

    def score_per_query_head(self, layer, seen_tokens):
        """[B, H_kv, G, cap]: the same scores before the reduction onto kv heads (for CAOTE's
        per-head errors, App. B.2), without repeating K/V onto the query heads."""
        last = window_attention(layer)[:, :, :, -1]  # [B, H_kv, G, cap]
        if self.heads == "layer":
            return last.mean(dim=(1, 2), keepdim=True).expand_as(last)
        return last

    def score(self, layer, seen_tokens):
        last = window_attention(layer)[:, :, :, -1]  # [B, H_kv, G, cap]
        per_head = reduce_group(last, "mean")  # [B, H_kv, cap]
        if self.heads == "layer":
            return per_head.mean(dim=1, keepdim=True).expand_as(per_head)
        return per_head
