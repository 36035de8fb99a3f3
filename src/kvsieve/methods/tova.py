"""TOVA: token omission via attention.

arXiv:2401.06104; official code: github.com/schwartz-lab-NLP/TOVA.

Based on Oren et al., "Transformers are Multi-State RNNs" (arXiv:2401.06104).  At each step
the token with the lowest attention from the *current* query is dropped (Sec. 3.3); the
paper averages the attention over all heads of a layer, so all heads keep the same tokens.

The current query's attention is taken from the forward pass itself (``observe``, kept as
per-token state ``last_attn``), not recomputed at compression time: one pass over the keys
per step instead of two.
"""

from dataclasses import dataclass, replace

from ..attention import window_attention
from ..policy import About, Needs, Scorer, check_choice, register
from ._common import reduce_group


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

    about = About("attention of the current query, averaged over heads", "Oren et al. 2024 (arXiv:2401.06104), Sec. 3.3")
    # last_attn: the newest query's attention, group mean per kv head; being the newest query's row
    # only, interval > 1 observes once per interval.  Per-token scores: the engine may evict in place.
    # One recent query: only score_per_query_head (CAOTE) reads it.
    needs = Needs(meta={"last_attn": 0.0}, observes=True, observes_last_only=True, query_window=1,
                  slot_order_free=True, stacks_layers=True)
    # Schedule (the engine's ``Defaults()``): interval 1, Sec. 3.3, a token dropped at each step; sinks and
    # recent 0 and protect_prompt False: Sec. 3.3 drops the lowest-scoring token of the whole cache, none
    # exempt (AMS App. B.2 caps its TOVA baseline's cache at T_keep, prompt included); compress_prefill
    # True: kvsieve's choice, so decoding starts within the budget, a multi-state of fixed size.  CAOTE's
    # Table 10 reads the prompt in blocks (32, 128) instead: ``prefill_block=True`` (128).
    heads: str = "layer"

    def __post_init__(self):
        check_choice(self.heads, ("layer", "group"), "tova heads")
        # the layer mean is one decision per slot for every head of the layer
        # heads="layer": the mean over the layer's kv heads of their scores (``score``)
        self.needs = replace(self.needs, aligned_heads=self.heads == "layer",
                             heads_combined_by="mean" if self.heads == "layer" else "")

    def observe(self, layer, probs, query_pos, steps=False):
        # probs: [B, H_kv, G, T, cap]; the call's last query is the newest token of every row
        layer.meta["last_attn"].copy_(reduce_group(probs[:, :, :, -1], "mean"))

    def score_per_query_head(self, layer, seen_tokens):
        """[B, H_kv, G, cap]: the same scores before the reduction onto kv heads (for CAOTE's
        per-head errors, App. B.2), without repeating K/V onto the query heads.  With
        heads="layer" every query head has the layer's mean score: it is read from the observed
        state as [B, H_kv, 1, cap] (G = 1, like a base whose state is per kv head), so no second
        pass over the keys is needed."""
        if self.heads == "layer":
            return self.score(layer, seen_tokens)[:, :, None]
        return window_attention(layer)[:, :, :, -1]  # [B, H_kv, G, cap]

    def score(self, layer, seen_tokens):
        per_head = layer.meta["last_attn"]  # [B, H_kv, cap]
        if self.heads == "layer":
            return per_head.mean(dim=1, keepdim=True).expand_as(per_head)
        return per_head
