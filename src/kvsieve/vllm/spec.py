"""kvsieve's KV cache spec: vLLM's full-attention spec that answers vLLM's start-up check with the
most a compressed request holds (``bounds.held_tokens``), not ``max_model_len``, so a server may
take requests longer than its KV pool (issue 59 item 1).  Registered through vLLM's public
registry of out-of-tree specs (``vllm/v1/kv_cache_spec_registry.py``), with vLLM's own manager
for full attention: blocks are allocated, shared and freed exactly as for full attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from .paged import blocks_for


@dataclass(frozen=True, kw_only=True)
class SieveAttentionSpec(FullAttentionSpec):
    """A full-attention layer whose requests hold at most ``max_kv_tokens`` tokens of KV (None:
    ``max_model_len``, as vLLM's own spec)."""

    max_kv_tokens: int | None = None

    def max_memory_usage_bytes(self, vllm_config) -> int:
        tokens = vllm_config.model_config.max_model_len
        if self.max_kv_tokens is not None:
            tokens = min(tokens, self.max_kv_tokens)
        return blocks_for(tokens, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list["SieveAttentionSpec"]) -> "SieveAttentionSpec":
        bounds = {spec.max_kv_tokens for spec in specs}
        if len(bounds) != 1:
            raise ValueError(f"kvsieve: layers of one KV cache group hold different bounds {sorted(bounds)}")
        return dataclasses.replace(super().merge(specs), max_kv_tokens=bounds.pop())


def bounded(specs: dict, max_kv_tokens: int) -> dict:
    """``specs`` (a layer's name -> its spec, from vLLM's model runner) with every full-attention
    spec made a ``SieveAttentionSpec`` of ``max_kv_tokens``; other specs (sliding windows, which
    the scheduler refuses) as they are."""
    return {name: SieveAttentionSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)},
                                     max_kv_tokens=max_kv_tokens)
            if type(spec) is FullAttentionSpec else spec for name, spec in specs.items()}


# vLLM fills its registry with its own specs only while the registry is empty, on first use: use it
# once (an empty check) before adding ours, or vLLM's own full-attention spec would be left out.
KVCacheSpecRegistry.check_kv_cache_spec_registry({})
KVCacheSpecRegistry.register(SieveAttentionSpec, FullAttentionManager, uniform_type_base_spec=FullAttentionSpec)
