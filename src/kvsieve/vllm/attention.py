"""vLLM's CPU attention backend, recording each request's recent post-RoPE queries for the
methods that score with them (SnapKV, TOVA, H2O, ...): vLLM's kernels return no attention
weights, so the worker scores the recorded queries against the cached keys when it compresses.

Installed through vLLM's attention registry (``register_backend(AttentionBackendEnum.CPU_ATTN,
...)``, the documented way to override a backend), by kvsieve's worker in its own process before
the model is built, so it never touches another engine.  Without a recorder attached it is vLLM's
backend exactly.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .rings import QueryRecorder

BACKEND_PATH = "kvsieve.vllm.attention.SieveCPUAttentionBackend"


class SieveCPUAttentionImpl(CPUAttentionBackendImpl):
    recorder: QueryRecorder | None = None  # set per instance by the model runner (``rings.QueryRecorder``)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if self.recorder is not None and attn_metadata is not None:
            self.recorder.record(layer.layer_name, query[: attn_metadata.num_actual_tokens])
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)


class SieveCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[SieveCPUAttentionImpl]:
        return SieveCPUAttentionImpl


def install() -> None:
    """Make this process's CPU_ATTN backend kvsieve's (vLLM's registry override).  vLLM's selector
    caches its choice per process (``v1/attention/selector.py``, ``@cache``): a worker process is
    new, but an engine run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the tests) after another
    one would keep the cached class, so the cache is cleared when the override is first made."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH:
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
