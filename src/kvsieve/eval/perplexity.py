"""Perplexity of a text under a compressed cache (teacher forcing).

The text's first ``budget`` tokens are prefilled in one pass (nothing is evicted yet), then the
rest is fed one token at a time, compressing on the policy's schedule, as in the long-text
language-modelling evaluations of StreamingLLM (Xiao et al. 2023, arXiv:2309.17453, Sec. 4.1)
and H2O: every token from the second on is scored.  ``full`` prefills the whole text at once.

The text runs through the same ``DecodeSession`` as ``generate``: one prefill, then one
decode step per token with the text's next token in place of a sampled one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..policy import Policy
from ..schedule import fitted
from ..session import DecodeSession


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


@torch.inference_mode()
def score_text(model, tokenizer, text: str, policy: Policy | None = None, max_tokens: int | None = None) -> TextScore:
    """Negative log-likelihood of ``text`` (its first ``max_tokens`` tokens) under ``policy``."""
    policy = policy or Policy(scorer=None)
    ids = tokenizer(text).input_ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError("perplexity needs a text of at least two tokens")
    ids_t = torch.tensor([ids], device=model.device)
    positions = torch.arange(len(ids), device=model.device)[None]
    prefill = len(ids) if policy.scorer is None else max(1, min(policy.budget or len(ids), len(ids)))
    policy = fitted(policy, len(ids), prompt=prefill)  # LagKV at a budget, as in generate
    session = DecodeSession(model, policy, batch_size=1, horizon=len(ids))
    start = time.perf_counter()
    with session.attached(tokenizer):
        logp = session.prefill(ids_t[:, :prefill], positions[:, :prefill], chunk=prefill, all_logits=True)
        logp = logp.float().log_softmax(dim=-1)  # [1, prefill, V]
        nll = -logp[0, :-1].gather(-1, ids_t[0, 1:prefill, None]).sum()  # a device scalar: no sync per token
        logp = logp[:, -1]  # [1, V]: the prediction of token `prefill`
        for t in range(prefill, len(ids)):
            nll = nll - logp[0, ids_t[0, t]]
            if t == len(ids) - 1:
                break
            logp = session.step(ids_t[:, t]).float().log_softmax(dim=-1)
        final, peak, _ = session.row_kv_tokens([0])
    score = TextScore(nll=nll.item(), scored_tokens=len(ids) - 1, prompt_tokens=len(ids), peak_kv_tokens=peak[0],
                      final_kv_tokens=final[0], peak_kv_bytes=session.peak_kv_bytes[0],
                      compression_events=session.compression_events[0], seconds=time.perf_counter() - start)
    return score
