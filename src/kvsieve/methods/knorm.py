"""Knorm: keep the keys with the smallest L2 norm.

arXiv:2406.11430; official code: github.com/alessiodevoto/l2compress.

Based on Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression" (arXiv:2406.11430): low key norm correlates with high attention, so the score is
the negated norm of the post-RoPE key. Attention-free.
"""

from dataclasses import dataclass, replace

from ..cache import kv_field
from ..policy import About, Needs, Scorer, register


@register("knorm")
@dataclass
class Knorm(Scorer):
    """Parameters
    ----------
    skip_layers : int, default 2
        The first ``skip_layers`` layers are never compressed and keep every token.  2 is the
        authors' setting: their released ``l2_compress`` example passes ``skip_layers=[0, 1]``,
        and LagKV (App. A.2, Eq. 14) skips the first two layers for its L2 variant "as suggested in
        their work".  0 compresses every layer (kvpress's KnormPress).
    """

    about = About("negated L2 norm of each key (attention-free); first two layers uncompressed",
                  "Devoto et al. 2024 (arXiv:2406.11430), Sec. 3; layers 0-1 skipped as in the authors' code")
    needs = Needs(kv_fields=("key_norm",), slot_order_free=True, stacks_layers=True)  # per-token scores: evicted in place
    # Schedule: the engine's ``Defaults()`` (sinks 0, recent 0, interval 1, compress_prefill True,
    # protect_prompt False, prefill_block 0), kvsieve's choice, none cited from the paper or the authors'
    # code: every token competes, prompt included, and the cache is held at the budget from prefill on
    # (kvpress's KnormPress likewise scores every prompt token, at prefill, with no sinks or window).
    skip_layers: int = 2

    def __post_init__(self):
        if self.skip_layers < 0:
            raise ValueError(f"knorm: skip_layers must be >= 0, got {self.skip_layers}")
        self.needs = replace(self.needs, whole_layers=self.skip_layers)

    def score(self, layer, seen_tokens):
        return -kv_field(layer, "key_norm")  # [B, H_kv, cap], computed once per token as it is appended
