"""KV memory planning: the most a generate call can allocate for its cache, decided up front.

``generate(..., GenerateConfig(kv_memory_gb=...))`` refuses a batch whose planned peak does
not fit (a clear error naming the largest batch that does) instead of running out of
memory half way; benchmarks use ``max_batch_size`` for admission under a fixed limit.

Per (row, kv head, layer) a cache never holds more slots than:

* no eviction (or a method without a budget): longest prompt + ``max_new_tokens``, or less
  for a method that bounds its own cache (LagKV, ``schedule.unbudgeted_peaks``): its peak, or
  the whole prompt held until its first compression when that is longer;
* a budget ``b`` with compression every ``interval`` steps: the whole prompt right after
  prefill, and ``b + interval`` while decoding (``H_kv * b + interval`` for allocators whose
  heads share slots), plus the prompt when the policy protects it (``protect_prompt``).

A slot costs K and V (``2 * head_dim`` elements), its int64 position and 4 bytes per float
metadata field of the policy. Transient copies during a compaction are not counted.
"""

from __future__ import annotations

import torch

from .policy import Policy
from .schedule import layer_budgets, unbudgeted_peaks

GB = 1024**3  # kv_memory_gb counts GiB


class KVMemoryError(ValueError):
    """The planned KV cache does not fit the configured memory limit."""


def bytes_per_slot(model, policy: Policy) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=model.dtype).element_size()
    n_meta = len(policy.scorer.needs.meta) + len(policy.scorer.needs.kv_fields) if policy.scorer is not None else 0
    return 2 * head_dim * element + 8 + 4 * n_meta


def slots_per_head(model, policy: Policy, prompt_len: int, max_new_tokens: int) -> list[int]:
    """Upper bound of each layer's capacity (slots per row and kv head)."""
    budgets = layer_budgets(policy, model.config.num_hidden_layers)
    unbudgeted = unbudgeted_peaks(policy, len(budgets), prompt_len + max_new_tokens, prompt_len)
    out = []
    for budget, own in zip(budgets, unbudgeted):
        if budget is None:
            out.append(max(prompt_len, own))
            continue
        per_head = model.config.num_key_value_heads * budget if policy.allocator.ragged_heads else budget
        decode_peak = per_head + policy.interval
        if policy.protect_prompt:  # the prompt stays, outside the budget
            decode_peak += prompt_len
        out.append(min(prompt_len + max_new_tokens, max(prompt_len + policy.interval, decode_peak)))
    return out


def planned_kv_bytes(model, policy: Policy, batch: int, prompt_len: int, max_new_tokens: int) -> int:
    """Planned peak allocated KV bytes of a batch whose longest prompt has ``prompt_len`` tokens."""
    slots = sum(slots_per_head(model, policy, prompt_len, max_new_tokens))
    return batch * model.config.num_key_value_heads * slots * bytes_per_slot(model, policy)


def max_batch_size(model, policy: Policy, prompt_len: int, max_new_tokens: int, kv_memory_gb: float) -> int:
    """Largest batch whose planned KV cache fits ``kv_memory_gb`` (0 if not even one row)."""
    per_row = planned_kv_bytes(model, policy, 1, prompt_len, max_new_tokens)
    return int(kv_memory_gb * GB // per_row)


def check_fits(model, policy: Policy, batch: int, prompt_len: int, max_new_tokens: int, kv_memory_gb: float) -> None:
    planned = planned_kv_bytes(model, policy, batch, prompt_len, max_new_tokens)
    if planned <= kv_memory_gb * GB:
        return
    fits = max_batch_size(model, policy, prompt_len, max_new_tokens, kv_memory_gb)
    raise KVMemoryError(
        f"planned peak KV cache {planned / GB:.3f} GiB for {batch} rows ({policy.name}, longest prompt "
        f"{prompt_len}, {max_new_tokens} new tokens) exceeds kv_memory_gb={kv_memory_gb}; "
        + (f"use a batch of at most {fits}" if fits else "not even one row fits")
        + ", a smaller budget, fewer new tokens, or a larger limit"
    )
