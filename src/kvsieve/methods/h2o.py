"""H2O: heavy-hitter oracle, accumulated attention.

arXiv:2306.14048; official code: github.com/FMInference/H2O.

Based on Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (arXiv:2306.14048).  Each cached token's score is the attention it has
received, summed over every query since it entered the cache (Sec. 3, Eq. of the greedy
eviction policy); half the budget is a recent window (Sec. 5: equal heavy-hitter and recent
budgets).  Decode-time: the sum is updated every step from the current query's attention.

As LazyEviction's baseline (its Tables 1-3, App. C) the recent window is LazyEviction's W
instead: ``recent_rule="lazy-window"``.
"""

from dataclasses import dataclass, replace

from ..policy import About, Defaults, Needs, Scorer, check_choice, register
from ._common import HEAD_REDUCTIONS, LAZY_WINDOW, reduce_group

RECENT_RULES = ("half", "lazy-window")


def half_budget(budget: int) -> int:
    """H2O's recent window: half the budget (Sec. 5: equal heavy-hitter and recent budgets)."""
    return budget // 2


@register("h2o")
@dataclass
class H2O(Scorer):
    """Accumulated attention.

    Parameters
    ----------
    head_reduction : str, default "sum"
        How the G query heads of a GQA group add up onto their kv head. H2O is defined per
        attention head (MHA); summing the group's attention is kvsieve's choice for GQA.
    recent_rule : str, default "half"
        The recent window when ``recent`` is not set.  "half": budget // 2, H2O's own setting
        (Sec. 5: equal heavy-hitter and recent budgets).  "lazy-window": LazyEviction's default
        window W = 25 (``_common.LAZY_WINDOW``, its Table 3 / Table 9 W for GSM8K), the H2O of
        LazyEviction's comparison: "the number of recent tokens in H2O is equal to
        LazyEviction's window size" (App. C); it evicts every step, and Table 3's "H2O + window"
        adds ``interval=25``.  For another W set ``recent=W``: an explicit ``recent`` overrides
        either rule.
    """

    about = About("accumulated attention received (heavy hitters) + recent window",
                  "Zhang et al. 2023 (arXiv:2306.14048), Sec. 5: heavy and recent budgets equal; recent_rule="
                  "'lazy-window': recent = LazyEviction's W, as its H2O baseline (LazyEviction App. C)")
    # the attention each token received, summed; per-token scores: the engine may evict in place
    # observes_steps: T steps' rows add up as T calls of one do (a sum; the order of the adds apart)
    needs = Needs(meta={"acc": 0.0}, observes=True, observes_steps=True, slot_order_free=True,
                  stacks_layers=True)
    # interval 1: the greedy eviction policy (Sec. 3) evicts at every decoding step; sinks 0 and
    # protect_prompt False: Sec. 5 splits the whole budget into heavy hitters and recent tokens, no share
    # for sinks or the prompt; compress_prefill True: kvsieve's choice, a prompt longer than the budget is
    # cut after prefill by the attention its own queries paid, so decoding starts within the budget
    defaults = Defaults(recent=half_budget,
                        recent_doc=f"budget // 2 ({LAZY_WINDOW} = lazy's W if recent_rule=lazy-window)")
    head_reduction: str = "sum"
    recent_rule: str = "half"

    def __post_init__(self):
        check_choice(self.head_reduction, HEAD_REDUCTIONS, "h2o head_reduction")
        check_choice(self.recent_rule, RECENT_RULES, "h2o recent_rule")
        if self.recent_rule == "lazy-window":
            self.defaults = replace(self.defaults, recent=LAZY_WINDOW)

    def observe(self, layer, probs, query_pos, steps=False):
        # probs: [B, H_kv, G, T, cap] -> summed over the group and the call's queries (T steps or a prefill chunk)
        layer.meta["acc"] += reduce_group(probs, self.head_reduction).sum(dim=2)

    def score(self, layer, seen_tokens):
        return layer.meta["acc"]
