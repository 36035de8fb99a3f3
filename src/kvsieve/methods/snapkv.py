"""SnapKV: attention of an observation window of recent queries, pooled.

arXiv:2404.14469; official code: github.com/FasterDecoding/SnapKV.

Based on Li et al., "SnapKV: LLM Knows What You Are Looking For Before Generation"
(arXiv:2404.14469), Sec. 4.2: the last ``window`` queries vote (attention summed over the
window), votes are smoothed by 1D pooling so neighbours of important tokens are kept, and the
window itself is kept.  Here the same rule also runs during decoding, with the window made of
the most recent generated queries.
"""

from dataclasses import dataclass, replace

from ..attention import window_attention
from ..policy import About, Defaults, Needs, Scorer, check_choice, register
from ._common import HEAD_REDUCTIONS, pool_along_sequence, reduce_group


@register("snapkv")
@dataclass
class SnapKV(Scorer):
    """Observation-window attention votes with pooling.

    Parameters
    ----------
    window : int, default 64
        Observation window (official SnapKV code default ``window_size=64``; the paper's
        LongBench runs also use 32). The window is protected as the recent tokens, and while
        decoding the cache is compressed every ``window`` steps (``Defaults.interval``).
    kernel : int, default 5
        Pooling kernel (official code ``kernel_size=5``).
    pooling : str, default "avg"
        "avg" or "max" (official code ``pooling='avgpool'``).
    head_reduction : str, default "mean"
        GQA reduction onto kv heads, kvsieve's choice (not in the paper).  The official code
        repeats the kv heads onto the query heads before voting (``repeat_kv``, "[SnapKV] move
        to ahead") and keeps tokens per query head, which a cache of H_kv heads cannot hold; the
        group mean is kvpress's SnapKVPress reading ("Average per group", SnapKV issue #22).
        "mean" and "sum" rank tokens alike here: a kv head's votes differ by the factor G.
    """

    about = About("observation-window attention votes, pooled",
                  "Li et al. 2024 (arXiv:2404.14469) Sec. 4.2; defaults from the official code")
    # protect_prompt False and compress_prefill True: Sec. 4.2 compresses the prompt itself, once, after
    # prefill (the window's votes pick the prompt tokens kept)
    defaults = Defaults(recent_doc="window", interval_doc="window")
    window: int = 64
    kernel: int = 5
    pooling: str = "avg"
    head_reduction: str = "mean"

    def __post_init__(self):
        if self.window < 1 or self.kernel < 1:
            raise ValueError(f"snapkv window and kernel must be >= 1, got {self.window}, {self.kernel}")
        check_choice(self.pooling, ("avg", "max"), "snapkv pooling")
        check_choice(self.head_reduction, HEAD_REDUCTIONS, "snapkv head_reduction")
        # Decode schedule (kvsieve's choice): the paper compresses once, after prefill; while
        # decoding kvsieve compresses every ``window`` steps, so each compression is voted on by a
        # fresh window.  interval=1 compresses every step at the cost of ``window`` attention rows
        # per step (about 6x a decode step at 2048 cached tokens on the 0.5B model).
        self.defaults = replace(self.defaults, recent=self.window, interval=self.window)
        self.needs = replace(self.needs, query_window=self.window, stacks_layers=True)  # the window's queries vote

    def score(self, layer, seen_tokens):
        votes = reduce_group(window_attention(layer).sum(dim=3), self.head_reduction)  # [B, H_kv, cap]
        return pool_along_sequence(votes, layer.live(), self.kernel, self.pooling)
