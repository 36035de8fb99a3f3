"""R-KV: attention importance minus key redundancy, for long reasoning outputs.

arXiv:2505.24133; official code: github.com/Zefan-Cai/R-KV.

Based on Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models"
(arXiv:2505.24133), Sec. 3.  Every ``interval`` (= the paper's buffer of 128) decode steps:
importance I_i is the attention of the last ``window`` queries on token i, averaged over the
window and max-pooled; redundancy R_i is token i's mean cosine similarity to the other cached
keys, softmax-normalised over tokens; the score is  lambda * I_i - (1 - lambda) * R_i.
The window's own tokens are kept (the recent protection).
"""

from dataclasses import dataclass, replace

import torch

from ..attention import window_attention
from ..policy import About, Defaults, Scorer, check_choice, register
from ._common import HEAD_REDUCTIONS, pool_along_sequence, reduce_group
from ._keysim import PARTNER_THRESHOLD, check_threshold, rkv_redundancy, unit_keys


@register("rkv")
@dataclass
class RKV(Scorer):
    """Importance + redundancy.

    Parameters
    ----------
    window : int, default 8
        Observation window alpha (paper Sec. 4 and official code ``window_size=8``).
    kernel : int, default 7
        Max-pooling kernel over importance (official code ``kernel_size=7``).
    mix_lambda : float, default 0.1
        Weight of importance (paper Sec. 4: lambda = 0.1; the official code uses 0.07).
    head_reduction : str, default "mean"
        GQA reduction of the importance onto kv heads: the group mean of the softmax
        probabilities, kvsieve's choice (the paper is silent on GQA).  It keeps the importance on
        one head's softmax scale beside the softmax-normalised redundancy, so lambda weighs the
        two as for one head ("sum" would scale the importance by G).  The official code instead
        reduces the group's logits before the softmax (``rkv/utils.py``
        ``compute_attention_scores``, ``pooling="max"`` by default).
    partner_threshold : float or None, default 0.5
        Cosine above which a key's last (latest) partner is exempted from its redundancy sum
        (official code ``rkv/utils.py`` ``cal_similarity(threshold=0.5, retain_direction="last")``).
        None: no exemption, kvsieve's earlier reading (O(cap) instead of O(cap^2) per head).
    """

    about = About("attention importance minus key-similarity redundancy",
                  "Cai et al. 2025 (arXiv:2505.24133) Sec. 3-4: alpha 8, lambda 0.1, buffer 128")
    # protect_prompt: prompt kept whole, only generated tokens compressed: AMS App. B.2 Table 11 ("protecting
    # the prompt prefix and most recent tokens") and issue 28's reading of the official code (paper silent)
    defaults = Defaults(interval=128, protect_prompt=True, recent_doc="window")
    window: int = 8
    kernel: int = 7
    mix_lambda: float = 0.1
    head_reduction: str = "mean"
    partner_threshold: float | None = PARTNER_THRESHOLD

    def __post_init__(self):
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"rkv mix_lambda must be in [0, 1], got {self.mix_lambda}")
        if self.window < 1 or self.kernel < 1:
            raise ValueError(f"rkv window and kernel must be >= 1, got {self.window}, {self.kernel}")
        check_choice(self.head_reduction, HEAD_REDUCTIONS, "rkv head_reduction")
        check_threshold(self.partner_threshold, "rkv partner_threshold")
        self.defaults = replace(self.defaults, recent=self.window)  # the window's own tokens are kept
        self.needs = replace(self.needs, query_window=self.window)

    def redundancy(self, layer) -> torch.Tensor:
        """[B, H_kv, cap]: softmax over live tokens of each key's mean cosine similarity to the
        others, last partners above ``partner_threshold`` exempted."""
        live = layer.live()  # [B, H_kv, cap]
        return rkv_redundancy(unit_keys(layer.keys, live), live, self.partner_threshold)

    def score(self, layer, seen_tokens):
        attn = window_attention(layer)  # [B, H_kv, G, w, cap]
        n_queries = (attn.sum(-1) > 0).sum(dim=3).clamp(min=1)  # real queries per (B, H, G)
        importance = reduce_group(attn.sum(dim=3) / n_queries[..., None], self.head_reduction)
        importance = pool_along_sequence(importance, layer.live(), self.kernel, "max")
        return self.mix_lambda * importance - (1 - self.mix_lambda) * self.redundancy(layer)
