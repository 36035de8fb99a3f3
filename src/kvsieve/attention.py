"""Attention over a SieveCache, registered with transformers' ``AttentionInterface``.

Models opt in with ``model.set_attn_implementation("kvsieve")`` (``kvsieve.generate`` does
this for the duration of a call).  The function is then called by every attention module with
post-RoPE ``query`` [B, H_q, T, D] and the whole store of its cache layer ``key``/``value``
[B, H_kv, capacity, D].  It builds the layer's own mask from the per-token positions
(dead slots, left padding and causality in a prefill chunk are all ``pos > query_pos``),
so the dense 4D mask the model would build is never needed.

GQA: query heads are grouped onto their kv head ([B, H_kv, G, T, D]); K/V are never repeated.
Attention probabilities are materialised only when the policy observes them this step.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .cache import DEAD_POS, SieveCache, SieveLayer

ATTN_IMPLEMENTATION = "kvsieve"

# Model families whose attention modules call ``past_key_values.update`` with post-RoPE keys
# and then the registered attention function (checked against transformers 5.x sources).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# Layer types kvsieve's attention computes as transformers does: causal, and causal within the
# ``sliding_window`` the attention module passes (Mistral for every layer, Qwen2/Qwen3 for the
# layers ``use_sliding_window`` makes sliding).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

# observer(layer, layer_idx, probs, query_pos): probs [B, H_kv, G, T, capacity] of this step's
# queries (zero rows for padding queries), query_pos [B, T] their positions.  It returns None,
# or weights W [B, H_kv, R, capacity] over the cached tokens whose mixes M = W V the scorer
# wants: M is computed in the same pass over V as the attention output and left, with M V^T,
# in ``layer.step_results["value_mix"]`` = (W, M, M V^T) for the compression after the step.
Observer = Callable[[SieveLayer, int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass
class StepState:
    """What one forward pass tells the attention function (passed as the ``kvsieve`` kwarg)."""

    cache: SieveCache
    query_pos: torch.Tensor  # [B, T] positions of the tokens in flight, DEAD_POS for padding
    observer: Observer | None = None


# The step of a cache that schedules itself (``kvsieve.hf.ScheduledCache``, driven by transformers'
# own ``generate``, which passes no ``kvsieve`` kwarg): set by the cache's ``update`` of a layer
# and read by the attention call that follows it in the same layer.
_SCHEDULED_STEP: contextvars.ContextVar[StepState | None] = contextvars.ContextVar("kvsieve_step", default=None)


def set_scheduled_step(state: StepState) -> None:
    """Hand ``state`` to the next attention call (made by a self-scheduling cache's ``update``)."""
    _SCHEDULED_STEP.set(state)


def _step_for(module, key: torch.Tensor) -> StepState:
    """The step of the self-scheduling cache whose layer ``module`` just updated: its store must
    be the ``key`` the model passes on, or the attention call belongs to another cache."""
    state = _SCHEDULED_STEP.get()
    _SCHEDULED_STEP.set(None)  # one attention call per update; no reference to the cache outlives it
    if state is None or state.cache.layers[module.layer_idx].keys is not key:
        raise RuntimeError(
            "attn_implementation='kvsieve' needs a kvsieve cache: call kvsieve.generate(...), pass "
            "cache=kvsieve.SieveCache.for_model(model, ...) to model.generate, or switch the model back "
            "with model.set_attn_implementation('sdpa')."
        )
    return state


@functools.cache
def _cache_kwarg(model_class: type) -> str:
    """The forward argument that takes the cache: ``cache`` from transformers 5.2x on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg_name(model) -> str:
    """The name ``model``'s forward takes its cache under (looked up once per model class)."""
    return _cache_kwarg(type(model))


def cache_kwargs(model, cache: SieveCache) -> dict:
    """``{name: cache, "use_cache": True}`` for ``model(...)``, with the name its transformers takes."""
    return {cache_kwarg_name(model): cache, "use_cache": True}


def check_supported(model) -> None:
    """Raise a clear error for a model kvsieve cannot drive."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"kvsieve does not support model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(Llama, Qwen2/2.5, Qwen3, Mistral and their R1-Distill variants)."
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise ValueError(
            f"model {model_type!r} has attention layers of type {other}; kvsieve supports "
            f"{' and '.join(ATTENTION_LAYER_TYPES)} layers only."
        )


def visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, H_kv, T, capacity] bool: which cached slots each query may attend to.

    key_pos: [B, H_kv, capacity] (DEAD_POS for dead/padding slots); query_pos: [B, T].  ``window``
    (a sliding-window layer): a query at position q sees keys at q - window < p <= q only, as
    transformers' ``sliding_window_overlay``.
    """
    keys, queries = key_pos[:, :, None, :], query_pos[:, None, :, None]
    allowed = keys <= queries
    return allowed if window is None else allowed & (keys > queries - window)


def attention_probs(query: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention rows in fp32, grouped by kv head: [B, H_kv, G, T, capacity].

    query: [B, H_q, T, D]; keys: [B, H_kv, capacity, D]; allowed: [B, H_kv, T, capacity].
    """
    B, Hq, T, D = query.shape
    H, cap = keys.shape[1], keys.shape[2]
    q = query.reshape(B, H, (Hq // H) * T, D).float() * scaling  # rows ordered (g, t): no copy of K per group
    scores = torch.matmul(q, keys.float().transpose(-1, -2)).view(B, H, Hq // H, T, cap)
    return scores.add_(masking_bias(allowed)[:, :, None]).softmax(dim=-1)


def masking_bias(allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` (bool) as float32 0 where True and -inf where False, to add to logits: bit for
    bit ``masked_fill(~allowed, -inf)``'s result (x + 0 is x), computed as 1 - 1/allowed.  On CPU a
    boolean mask broadcast over a query group fills element by element: attention rows of 13 x 3
    x 3 x 128 queries over 160 slots take 15.2 ms so against 5.6 ms with the bias."""
    return allowed.view(torch.uint8).to(torch.float32).reciprocal_().neg_().add_(1)


def window_attention(layer: SieveLayer, rows: slice = slice(None)) -> torch.Tensor:
    """Attention of the layer's recent queries over its current cache: [B, H_kv, G, w, capacity]
    (``rows``: those rows of the batch only).

    Rows of padding queries are zero, so sums over the window count real queries only.
    """
    if layer.recent_queries is None:
        raise RuntimeError("window_attention: no queries recorded; the scorer must set query_window > 0")
    qpos = layer.recent_query_pos[rows]  # [B, w]
    probs = attention_probs(layer.recent_queries[rows], layer.keys[rows],
                            visible(layer.meta["pos"][rows], qpos, layer.sliding_window), layer.scaling)
    real = qpos != DEAD_POS  # [B, w]; the newest query is always a real token (left padding comes first)
    if bool(real.all()):
        return probs
    return probs.mul_(real[:, None, None, :, None])  # in place: probs can be large


def _grouped_sdpa(query, key, value, allowed, scaling):
    """Fused SDPA with queries grouped onto kv heads. Returns [B, H_q, T, D]."""
    B, Hq, T, D = query.shape
    H, cap = key.shape[1], key.shape[2]
    G = Hq // H
    if T == 1:  # decode: the G query heads of a group are G rows sharing one mask row
        q, mask = query.view(B, H, G, D), allowed
    else:  # prefill chunk: rows ordered (g, t), the mask repeated over g
        q = query.reshape(B, H, G * T, D)
        mask = allowed[:, :, None].expand(B, H, G, T, cap).reshape(B, H, G * T, cap)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, Hq, T, value.shape[-1])


def sieve_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, kvsieve=None,
                    sliding_window=None, **kwargs):
    """The registered attention function. Returns ([B, T, H_q, D], None).  ``sliding_window``: the
    window of a sliding-window layer, as the attention module passes it (None: full attention)."""
    if kvsieve is None:  # transformers' own generate over a ScheduledCache
        kvsieve = _step_for(module, key)
    layer = kvsieve.cache.layers[module.layer_idx]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer.begin_attention(query, kvsieve.query_pos, scaling, sliding_window)
    allowed = visible(layer.meta["pos"], kvsieve.query_pos, sliding_window)  # [B, H_kv, T, cap]
    if kvsieve.observer is not None:
        probs = attention_probs(query, key, allowed, scaling)  # [B, H_kv, G, T, cap]
        real = (kvsieve.query_pos != DEAD_POS)[:, None, None, :, None]  # padding queries attend to nothing
        mix_weights = kvsieve.observer(layer, module.layer_idx, probs * real, kvsieve.query_pos)
        B, H, G, T, cap = probs.shape
        rows = probs.to(value.dtype).view(B, H, G * T, cap)
        if mix_weights is None:
            out = torch.matmul(rows, value)  # [B, H_kv, G*T, D]
        else:  # the scorer's value mixes ride along the same pass over V (CAOTE's output, Eq. 20)
            out = torch.matmul(torch.cat([rows, mix_weights.to(value.dtype)], dim=2), value)
            mix = out[:, :, G * T:]  # [B, H_kv, R, D]
            # the mixes' dot products with every value, while V is still in the CPU's cache
            layer.keep_step_result("value_mix", (mix_weights, mix, torch.matmul(mix, value.transpose(-1, -2))))
            out = out[:, :, : G * T]
        out = out.reshape(B, H * G, T, value.shape[-1])
    else:
        out = _grouped_sdpa(query, key, value, allowed, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, sieve_attention)
