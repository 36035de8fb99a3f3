"""StreamingLLM: attention sinks plus a sliding window of recent tokens.

arXiv:2309.17453; official code: github.com/mit-han-lab/streaming-llm.

Based on Xiao et al., "Efficient Streaming Language Models with Attention Sinks"
(arXiv:2309.17453).  The first ``sinks`` tokens are kept forever; everything else is a
window of the most recent tokens.  Expressed as a scorer, a token's score is its position,
so after the sinks the newest ``budget - sinks`` tokens win.
"""

from dataclasses import dataclass

from ..policy import About, Defaults, Needs, Scorer, register


@register("streaming")
@dataclass
class StreamingLLM(Scorer):
    """Sinks + recent window. No hyperparameters of its own; ``sinks`` defaults to 4
    (StreamingLLM Sec. 3.2: four initial tokens suffice as attention sinks)."""

    about = About("attention sinks + sliding window of recent tokens",
                  "Xiao et al. 2023 (arXiv:2309.17453), Sec. 3.2: 4 sink tokens")
    needs = Needs(slot_order_free=True, stacks_layers=True)  # per-token scores: the engine may evict in place
    # interval 1, compress_prefill True and protect_prompt False: the cache is the sinks plus a rolling
    # window of the newest tokens whatever their source (Sec. 3.2), so a prompt longer than the budget is
    # cut to it after prefill and evicted token by token after; kvsieve's reading, also AMS App. B.2's,
    # which caps its StreamingLLM baseline's cache, prompt included, at T_keep
    defaults = Defaults(sinks=4)

    def score(self, layer, seen_tokens):
        return layer.meta["pos"].float()  # newer is better
