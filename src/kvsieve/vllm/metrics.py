"""kvsieve's own Prometheus series on the server's ``/metrics``, beside vLLM's (issue 59): proof
that eviction ran, on the dashboards a server already has.

The counts are the worker's (``WorkerCounts``, kept by ``SieveCPUModelRunner`` as it applies the
scheduler's compactions); the OpenAI server reads them with vLLM's public call into every worker
(``engine_client.collective_rpc("kvsieve_stats")``, vllm/v1/engine/async_llm.py) when ``/metrics``
is asked for, and ``SieveMetrics``, an ASGI middleware given with vLLM's ``--middleware`` (as the
request gate is), appends them to vLLM's page in Prometheus' text format.  Every rank of a
tensor-parallel server applies the same compactions; the first worker's counts are shown.

Series, each labelled with the served method:

* ``kvsieve_compactions_total``: request compactions applied;
* ``kvsieve_evicted_tokens_total``: tokens evicted, per request compaction (``kv_len - keep``,
  in every layer and kv head alike);
* ``kvsieve_freed_blocks_total``: KV blocks given back to vLLM's pool by compactions;
* ``kvsieve_failed_requests_total``: requests ended because their compaction failed;
* ``kvsieve_compaction_seconds_total`` and ``kvsieve_step_seconds_total``: time spent compacting
  and in whole steps (their ratio is the share of step time spent compacting);
* ``kvsieve_request_kv_tokens``: a histogram of the KV tokens each scheduled request holds,
  observed every step (its buckets: ``KV_BUCKETS``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from typing import Any

from .request_gate import Message, Scope

# bucket bounds of kvsieve_request_kv_tokens (tokens): a power-of-two ladder from a small budget to
# a long trace
KV_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class WorkerCounts:
    """What a worker counts as it applies compactions (the source of every kvsieve series)."""

    compactions: int = 0
    evicted_tokens: int = 0
    freed_blocks: int = 0
    failed_requests: int = 0
    compact_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0
    kv_buckets: list[int] = field(default_factory=lambda: [0] * (len(KV_BUCKETS) + 1))  # last: +Inf
    kv_sum: int = 0
    kv_count: int = 0

    def observe_kv(self, lengths: list[int]) -> None:
        """One step's KV tokens of each scheduled request, into the histogram."""
        for n in lengths:
            self.kv_buckets[bisect_left(KV_BUCKETS, n)] += 1  # the first bound >= n; past the last: +Inf
        self.kv_sum += sum(lengths)
        self.kv_count += len(lengths)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def prometheus_text(counts: dict[str, Any], method: str) -> str:
    """``counts`` (``WorkerCounts.as_dict``) as Prometheus' text exposition format, every series
    labelled ``method``."""
    label = 'method="' + method.replace("\\", "\\\\").replace('"', '\\"') + '"'
    lines = []
    for name, key, kind, text in (
            ("kvsieve_compactions_total", "compactions", "counter", "Request compactions applied."),
            ("kvsieve_evicted_tokens_total", "evicted_tokens", "counter",
             "Tokens evicted per request compaction (in every layer and kv head alike)."),
            ("kvsieve_freed_blocks_total", "freed_blocks", "counter", "KV blocks given back by compactions."),
            ("kvsieve_failed_requests_total", "failed_requests", "counter",
             "Requests ended because their compaction failed."),
            ("kvsieve_compaction_seconds_total", "compact_s", "counter", "Seconds spent compacting."),
            ("kvsieve_step_seconds_total", "step_s", "counter", "Seconds spent in whole steps.")):
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {counts[key]}"]
    name = "kvsieve_request_kv_tokens"
    lines += [f"# HELP {name} KV tokens held by each scheduled request, every step.", f"# TYPE {name} histogram"]
    cumulative = 0
    for bound, count in zip([*map(str, KV_BUCKETS), "+Inf"], counts["kv_buckets"]):
        cumulative += count
        lines.append(f'{name}_bucket{{{label},le="{bound}"}} {cumulative}')
    lines += [f"{name}_sum{{{label}}} {counts['kv_sum']}", f"{name}_count{{{label}}} {counts['kv_count']}"]
    return "\n".join(lines) + "\n"


class SieveMetrics:
    """ASGI middleware (``--middleware kvsieve.vllm.metrics.SieveMetrics``): ``GET /metrics`` is
    vLLM's page with kvsieve's series appended (``prometheus_text``), asked of vLLM uncompressed so
    they can be appended; every other request goes to vLLM's app as it came."""

    def __init__(self, app) -> None:
        self.app = app
        self.method: str | None = None  # the served method's name: read at the first scrape

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "GET" or scope.get("path") != "/metrics":
            return await self.app(scope, receive, send)
        plain = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"accept-encoding"]}
        start: Message = {}
        chunks: list[bytes] = []

        async def keep(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(plain, receive, keep)
        body = b"".join(chunks)
        if start.get("status") == 200:
            body += (await self.kvsieve_text(scope)).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def kvsieve_text(self, scope: Scope) -> str:
        """kvsieve's series, from the first worker's counts (empty when the engine does not answer)."""
        from .plan import settings_of

        state = scope["app"].state
        if self.method is None:  # the settings are the server's for its life: built once, not per scrape
            self.method = settings_of(state.vllm_config).method
        try:
            counts = await state.engine_client.collective_rpc("kvsieve_stats", timeout=10)
        except Exception:  # noqa: BLE001: a busy or failed engine must not take vLLM's page down with it
            return ""
        return prometheus_text(counts[0], self.method) if counts else ""
