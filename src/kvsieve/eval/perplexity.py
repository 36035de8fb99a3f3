"""Perplexity of a text under a compressed cache (teacher forcing).

The text's first ``budget`` tokens are prefilled in one pass (nothing is evicted yet), then the
rest is fed one token at a time, compressing on the policy's schedule, as in the long-text
language-modelling evaluations of StreamingLLM (Xiao et al. 2023, arXiv:2309.17453, Sec. 4.1)
and H2O: every token from the second on is scored.  ``full`` prefills the whole text at once.

deviation: ``kvsieve.generate`` has no teacher-forcing mode, so the cache set-up below repeats
the few lines of ``generate`` that build a ``SieveCache`` for a policy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..attention import ATTN_IMPLEMENTATION, StepState, cache_kwargs, check_supported
from ..cache import SieveCache
from ..policy import Policy, compress, drop_dead


@dataclass
class TextScore:
    """Summed negative log-likelihood (nats) of ``scored_tokens`` tokens, and cache statistics
    in the units of ``RowStats`` (live tokens per layer summed over kv heads)."""

    nll: float
    scored_tokens: int
    prompt_tokens: int
    peak_kv_tokens: list[int] = field(default_factory=list)
    final_kv_tokens: list[int] = field(default_factory=list)
    peak_kv_bytes: int = 0
    compression_events: int = 0
    seconds: float = 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / max(self.scored_tokens, 1))


def _step(model, cache: SieveCache, input_ids, positions, observer) -> torch.Tensor:
    cache.begin_step(positions)
    state = StepState(cache=cache, query_pos=positions, observer=observer)
    out = model(input_ids=input_ids, position_ids=positions, **cache_kwargs(model, cache),
                logits_to_keep=0, kvsieve=state)
    return out.logits.float().log_softmax(dim=-1)  # [1, T, V]


@torch.inference_mode()
def score_text(model, tokenizer, text: str, policy: Policy | None = None, max_tokens: int | None = None) -> TextScore:
    """Negative log-likelihood of ``text`` (its first ``max_tokens`` tokens) under ``policy``."""
    policy = policy or Policy(scorer=None)
    check_supported(model)
    ids = tokenizer(text).input_ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError("perplexity needs a text of at least two tokens")
    device = model.device
    ids_t = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device)[None]
    scorer, num_layers = policy.scorer, model.config.num_hidden_layers
    budgets = policy.layer_budgets(num_layers)
    cache = SieveCache.for_scorer(num_layers, scorer)
    for layer in cache.layers:
        layer.query_window = scorer.query_window() if scorer else 0
    observer = policy.observer()
    prefill = len(ids) if scorer is None else max(1, min(policy.budget or len(ids), len(ids)))
    start = time.perf_counter()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        cache.seen_tokens = torch.zeros(1, dtype=torch.long, device=device)
        logp = _step(model, cache, ids_t[:, :prefill], positions[:, :prefill], observer)
        nll = -logp[0, :-1].gather(-1, ids_t[0, 1:prefill, None]).sum().item() if prefill > 1 else 0.0
        cache.seen_tokens = torch.tensor([prefill], device=device)
        drop_dead(cache, headroom=policy.interval if scorer else 256,
                  past_hint=scorer is not None and not policy.compress_prefill)
        score = TextScore(nll=0.0, scored_tokens=len(ids) - 1, prompt_tokens=len(ids))
        peak = cache.live_tokens()[0]
        for t in range(prefill, len(ids)):
            nll -= logp[0, -1, ids[t]].item()
            if t == len(ids) - 1:
                break
            logp = _step(model, cache, ids_t[:, t:t + 1], positions[:, t:t + 1], observer)
            cache.seen_tokens = cache.seen_tokens + 1
            score.peak_kv_bytes = max(score.peak_kv_bytes, cache.allocated_bytes())
            if scorer is not None and (t + 1 - prefill) % policy.interval == 0 and policy.needs_compression(cache, budgets):
                peak = torch.maximum(peak, cache.live_tokens()[0])
                score.compression_events += int(compress(cache, policy, budgets))
        score.peak_kv_bytes = max(score.peak_kv_bytes, cache.allocated_bytes())
        final = cache.live_tokens()[0]
        score.peak_kv_tokens, score.final_kv_tokens = torch.maximum(peak, final).tolist(), final.tolist()
    finally:
        model.set_attn_implementation(previous)
    score.nll, score.seconds = nll, time.perf_counter() - start
    return score
