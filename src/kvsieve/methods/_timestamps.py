"""Attention timestamps, shared by LazyEviction (``lazy``), RaaS (``raas``) and ``kvsieve analyze mri``.

Per cached token and kv head, ``meta["ts"]`` is TS, the last step at which the token's
attention was at least alpha (LazyEviction Sec. 4, "Recurrence Interval Tracking", taken from
RaaS), and ``meta["mri"]`` (LazyEviction only) is MRI, the longest gap between two such steps
(Eq. 1).  Both are per-token metadata, compacted with K/V by the engine's one gather.

Clock: a step is named by its query's position.  Decode step t is the query at position
``prompt_len + t - 1`` (step 0, the prefill, ends with the prompt's last query); differences
``t - TS`` (all the method uses) are the paper's, and rows of a batch with different prompt
lengths need no offset.  A token is born at the step that appends it: new tokens enter with
``TS_UNSET`` and the first observe (or score) sets TS to the token's own position
(``born_timestamps``), so a token attended at its birth step gets a gap of 0 and MRI stays 0
("never activated since its generation", Sec. 4).  When the prompt's queries are not steps
(``lazy``'s default), the prompt is appended by one step, the prefill: ``prefill_timestamps``
gives every prompt token that step as its birth.  RaaS and ``kvsieve analyze mri`` (through
``lazy``) share this clock.

GQA: the attention a kv head's token receives is reduced over the G query heads of the group
(``head_reduction``); the paper (MHA view) leaves this open.  "mean" keeps one softmax row's
scale, so alpha means the same as for one head; "sum" is G times larger, "max" in between.
"""

from __future__ import annotations

import contextlib

import torch

from ..cache import DEAD_POS
from ..checks import SettingError
from ._common import reduce_group

TS_UNSET = -1.0  # meta_init of "ts": replaced by the token's own position (its birth step)

# LazyEviction App. C / App. G.2, Table 10: alpha 5e-4 for DeepSeek-R1-Distill-Llama-8B and
# 1e-4 for DS-Qwen-7B, Qwen3-4B and QwQ-32B.  Keyed by transformers' model_type; any other
# model of a family (SmolLM2 is "llama", Qwen2.5-Coder "qwen2") and mistral (taken as
# Llama-like) are kvsieve's extrapolation, not measured by the paper.
ALPHA_BY_FAMILY = {"llama": 5e-4, "mistral": 5e-4, "qwen2": 1e-4, "qwen3": 1e-4}
MODEL_FAMILY = "auto"  # ``family`` default: the model's own (its config.model_type), read per call


def resolve_alpha(alpha: float | None, family: str, method: str) -> float | None:
    """alpha itself, or the Table 10 value of ``family`` when alpha is None; None when alpha
    follows the model's family (``MODEL_FAMILY``), set per call by ``alpha_for_call``.  An alpha
    must be in (0, 1]."""
    if alpha is None:
        if family == MODEL_FAMILY:
            return None
        if family not in ALPHA_BY_FAMILY:
            raise ValueError(f"{method} family must be {MODEL_FAMILY!r} or one of {sorted(ALPHA_BY_FAMILY)} "
                             f"(or set alpha explicitly), got {family!r}")
        alpha = ALPHA_BY_FAMILY[family]
    if not 0.0 < float(alpha) <= 1.0:
        raise ValueError(f"{method} alpha must be in (0, 1] (an attention threshold), got {alpha}")
    return float(alpha)


def model_alpha(model, who: str, setting: str, fix: str) -> float:
    """The Table 10 alpha of ``model``'s family (``config.model_type``); a type the table gives no
    value for is refused as a ``SettingError`` on ``setting``, whose fix the caller names."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ALPHA_BY_FAMILY:
        raise SettingError(setting, f"{who}: LazyEviction's Table 10 gives no alpha for model type "
                           f"{model_type!r}; set {{name}} {fix}")
    return ALPHA_BY_FAMILY[model_type]


@contextlib.contextmanager
def alpha_for_call(scorer, model):
    """A timestamp scorer's ``attach``: for one generate call, ``scorer.call_alpha`` is its alpha,
    or with ``family="auto"`` the Table 10 value of the model's family (``config.model_type``:
    SmolLM2 and Llama "llama", Qwen2.5 "qwen2")."""
    alpha = scorer.alpha
    if alpha is None:
        alpha = model_alpha(model, scorer.name, "family", f"to one of {sorted(ALPHA_BY_FAMILY)} or set alpha")
    scorer.call_alpha = alpha
    try:
        yield None
    finally:
        scorer.call_alpha = None


def threshold(scorer) -> float:
    """The alpha a timestamp scorer observes with: its own, else its call's (``alpha_for_call``)."""
    alpha = scorer.alpha if scorer.alpha is not None else scorer.call_alpha
    if alpha is None:
        raise RuntimeError(f"{scorer.name}: alpha follows the model's family (family='auto'), known only "
                           "inside a generate call (the scorer's attach); set family or alpha to use it alone")
    return alpha


def born_timestamps(layer) -> torch.Tensor:
    """[B, H_kv, cap] TS with every live unset entry replaced by the token's own position."""
    ts = layer.meta["ts"]
    unset = (ts < 0) & layer.live()
    return torch.where(unset, layer.meta["pos"].to(ts.dtype), ts)


def prefill_timestamps(layer, query_pos: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, cap] TS with every live token of a row born at this prefill call, taken as one
    step named by the row's last query (query_pos [B, T], DEAD_POS on padding).  After the
    prompt's last chunk that is the prompt's last position: decoding step 0."""
    ts = layer.meta["ts"]
    step = torch.where(query_pos != DEAD_POS, query_pos, -1).amax(dim=1)  # [B]; -1: padding only
    return torch.where(layer.live(), step.to(ts.dtype)[:, None, None], ts)


def observe_timestamps(layer, probs: torch.Tensor, query_pos: torch.Tensor, alpha: float,
                       head_reduction: str, track_mri: bool) -> None:
    """Algorithm 1, lines 1-6, for this call's T queries taken as T steps in position order.

    probs: [B, H_kv, G, T, cap] (zero rows for padding queries, zeros on masked slots, so
    neither can reach alpha > 0); query_pos: [B, T].  Line 3: TS = t where A_t >= alpha.
    Line 6 / Eq. (1): MRI_t = max(MRI_{t-1}, TS_t - TS_{t-1}), the previous TS being the last
    activation before each query (a running max over the T queries, so a prefill chunk gives
    what T single decode steps would).
    """
    ts = born_timestamps(layer)  # [B, H, cap]
    attn = reduce_group(probs, head_reduction)  # [B, H, T, cap]
    if attn.shape[2] == 1:  # a decode step: TS <= t already, so line 3 is a select, not a max
        hit = attn[:, :, 0] >= alpha  # [B, H, cap]
        now = query_pos.to(ts.dtype)[:, :, None]  # [B, 1, 1]
        if track_mri:  # Eq. (1) from the stored (previous) TS
            torch.maximum(layer.meta["mri"], torch.where(hit, now - ts, float("-inf")), out=layer.meta["mri"])
        torch.where(hit, now, ts, out=layer.meta["ts"])  # in place (captured steps)
        return
    step = query_pos.to(attn.dtype)[:, None, :, None]  # [B, 1, T, 1]
    hit = torch.where(attn >= alpha, step, float("-inf"))  # step of each activation, -inf if none
    new_ts = torch.maximum(ts, hit.amax(dim=2))  # Alg. 1 line 3
    if track_mri:  # Alg. 1 line 6, from the *previous* TS
        # TS_{t-1} seen by each query: the old TS, then activations of earlier queries of this call,
        # a running max over the T queries (a loop of [B, H, cap] maxima: CPU's cummax along T is
        # element by element, 4-20x slower at 32-512 queries)
        before, gap = ts.clone(), torch.full_like(ts, float("-inf"))  # gap: -inf where never activated
        since = torch.empty_like(ts)  # this query's gap, written in place each time
        for t in range(hit.shape[2]):
            torch.maximum(gap, torch.sub(hit[:, :, t], before, out=since), out=gap)
            torch.maximum(before, hit[:, :, t], out=before)
        torch.maximum(layer.meta["mri"], gap, out=layer.meta["mri"])  # Eq. (1), in place
    layer.meta["ts"].copy_(new_ts)  # in place: per-token state keeps its address (captured steps)
