"""R-KV: attention importance minus key redundancy, for long reasoning outputs.

arXiv:2505.24133; official code: github.com/Zefan-Cai/R-KV.

Based on Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models"
(arXiv:2505.24133), Sec. 3.  Every ``interval`` (= the paper's buffer of 128) decode steps:
importance I_i is the attention of the last ``window`` queries on token i, averaged over the
window and max-pooled; redundancy R_i is token i's mean cosine similarity to the other cached
keys, softmax-normalised over tokens; the score is  lambda * I_i - (1 - lambda) * R_i.
The window's own tokens are kept (the recent protection).

Defaults follow the official code (``rkv/compression/r1_kv.py`` ``R1KV.update_kv``,
``rkv/utils.py`` ``compute_attention_scores``), each other reading a named option:

* the prompt competes: the official code compresses the prompt at prefill once it reaches the
  budget, and generated tokens compete with it afterwards (``protect_prompt=True``: the prompt
  kept outside the budget, AMS App. B.2 Table 11's setting and kvsieve's default before issue 51);
* importance is a softmax over the keys *before* the observation window only: the window's
  queries score ``keys[:-window]`` (``window_keys=True``: over every key the query sees);
* GQA: the group's max of the logits, before the softmax (``head_reduction="max-logits"``;
  "mean", "max" or "sum" reduce the per-head softmax probabilities instead);
* lambda = 0.07, the official code's ``mix_lambda`` (the paper's Sec. 4 says 0.1).

One deviation stays the default: the interval is capped at budget // 2 (``capped_interval``, issue
28), so the cache peaks at 1.5x the budget; the official buffer of 128 lets it reach budget + 128
(``--set rkv.interval=128`` with ``--interval 128`` restores that).
"""

from dataclasses import dataclass, replace

import torch

from ..attention import visible
from ..cache import DEAD_POS
from ..policy import About, Defaults, Scorer, check_choice, register
from ._common import HEAD_REDUCTIONS, pool_along_sequence, reduce_group
from ._keysim import PARTNER_THRESHOLD, check_threshold, rkv_redundancy, unit_keys

# GQA reductions: the official group max of logits before the softmax, or a reduction of the
# per-query-head softmax probabilities (kvsieve's reading before issue 51: "mean")
RKV_HEAD_REDUCTIONS = ("max-logits",) + HEAD_REDUCTIONS


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
    mix_lambda : float, default 0.07
        Weight of importance: the official code's ``R1KV(mix_lambda=0.07)``; the paper's Sec. 4
        says lambda = 0.1.
    head_reduction : str, default "max-logits"
        GQA reduction onto kv heads.  "max-logits": the group's max of the scaled logits, then one
        softmax per kv head (official ``compute_attention_scores(pooling="max")``).  "mean",
        "max", "sum": a softmax per query head, then the group's mean (kvsieve's reading before
        issue 51, which keeps the importance on one head's scale), max or sum of probabilities.
    window_keys : bool, default False
        False: each window query's softmax runs over the keys before the window only (official
        ``softmax(attn_weights[..., -window:, :-window])``); the window's own keys get importance 0
        (they are kept anyway).  True: over every key the query sees (kvsieve before issue 51).
    partner_threshold : float or None, default 0.5
        Cosine above which a key's last (latest) partner is exempted from its redundancy sum
        (official code ``rkv/utils.py`` ``cal_similarity(threshold=0.5, retain_direction="last")``).
        None: no exemption, kvsieve's earlier reading (O(cap) instead of O(cap^2) per head).
    """

    about = About("attention importance minus key-similarity redundancy",
                  "Cai et al. 2025 (arXiv:2505.24133) Sec. 3-4; official code: alpha 8, lambda 0.07, buffer 128, "
                  "prompt compressed at prefill")
    # protect_prompt False: the official code compresses the prompt at prefill once it reaches the
    # budget (modeling.py), so the prompt competes with generated tokens; compress_prefill True
    defaults = Defaults(interval=128, protect_prompt=False, recent_doc="window")
    window: int = 8
    kernel: int = 7
    mix_lambda: float = 0.07
    head_reduction: str = "max-logits"
    window_keys: bool = False
    partner_threshold: float | None = PARTNER_THRESHOLD

    def __post_init__(self):
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"rkv mix_lambda must be in [0, 1], got {self.mix_lambda}")
        if self.window < 1 or self.kernel < 1:
            raise ValueError(f"rkv window and kernel must be >= 1, got {self.window}, {self.kernel}")
        check_choice(self.head_reduction, RKV_HEAD_REDUCTIONS, "rkv head_reduction")
        check_threshold(self.partner_threshold, "rkv partner_threshold")
        self.defaults = replace(self.defaults, recent=self.window)  # the window's own tokens are kept
        self.needs = replace(self.needs, query_window=self.window, stacks_layers=True,
                             compares_keys=True)

    def redundancy(self, layer) -> torch.Tensor:
        """[B, H_kv, cap]: softmax over live tokens of each key's mean cosine similarity to the
        others, last partners above ``partner_threshold`` exempted."""
        live = layer.live()  # [B, H_kv, cap]
        return rkv_redundancy(unit_keys(layer.keys, live), live, self.partner_threshold)

    def importance(self, layer) -> torch.Tensor:
        """[B, H_kv, cap]: the window queries' attention on each slot, averaged over the real
        queries (padding queries left out), before pooling."""
        queries, qpos = layer.recent_queries, layer.recent_query_pos  # [B, H_q, w, D], [B, w]
        if queries is None:
            raise RuntimeError("rkv: no queries recorded; query_window must be > 0")
        B, Hq, w, D = queries.shape
        keys, key_pos = layer.keys, layer.meta["pos"]  # [B, H, cap, D], [B, H, cap]
        H, cap = keys.shape[1], keys.shape[2]
        q = queries.reshape(B, H, (Hq // H) * w, D).float() * layer.scaling  # rows ordered (g, t)
        logits = torch.matmul(q, keys.float().transpose(-1, -2)).view(B, H, Hq // H, w, cap)
        real = (qpos != DEAD_POS)[:, None, :, None]  # [B, 1, w, 1]: padding queries see nothing
        allowed = visible(key_pos, qpos, layer.sliding_window) & real  # [B, H, w, cap]
        if not self.window_keys:  # only keys older than the window's oldest real query (padding: DEAD_POS)
            oldest = qpos.amin(dim=1)  # [B]
            allowed = allowed & (key_pos < oldest[:, None, None])[:, :, None, :]
        if self.head_reduction == "max-logits":
            probs = logits.amax(dim=2).masked_fill_(~allowed, float("-inf")).softmax(dim=-1)  # [B, H, w, cap]
        else:
            probs = logits.masked_fill_(~allowed[:, :, None], float("-inf")).softmax(dim=-1)  # [B, H, G, w, cap]
        probs = probs.nan_to_num_(0.0)  # a query with no allowed key (padding, or nothing before the window)
        rows = probs.sum(dim=-1) > 0  # real queries per head: [B, H, w] or [B, H, G, w]
        mean = probs.sum(dim=-2) / rows.sum(dim=-1, keepdim=True).clamp(min=1)
        return mean if self.head_reduction == "max-logits" else reduce_group(mean, self.head_reduction)

    def score(self, layer, seen_tokens):
        importance = pool_along_sequence(self.importance(layer), layer.live(), self.kernel, "max")
        return self.mix_lambda * importance - (1 - self.mix_lambda) * self.redundancy(layer)
