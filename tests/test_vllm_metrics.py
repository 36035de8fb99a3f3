"""kvsieve's /metrics series (``kvsieve.vllm.metrics``): the text Prometheus reads, the histogram's
buckets, and the middleware that appends them to vLLM's page, here in front of a stand-in for
vLLM's app and engine client.  Plain Python, no vLLM: a served server's page is read in
test_vllm_server.py, and the worker's counts against the scheduler's in test_vllm_failures.py."""

import asyncio
from types import SimpleNamespace

from kvsieve.vllm.metrics import KV_BUCKETS, SieveMetrics, WorkerCounts, prometheus_text


def test_kv_lengths_fall_in_the_first_bucket_that_holds_them():
    counts = WorkerCounts()
    counts.observe_kv([1, 32, 33, 64, 65, 40000])
    # le=32: 1 and 32; le=64: 33 and 64; le=128: 65; +Inf: 40000 (above the last bound, 32768)
    assert counts.kv_buckets == [2, 2, 1] + [0] * (len(KV_BUCKETS) - 3) + [1]
    assert (counts.kv_sum, counts.kv_count) == (1 + 32 + 33 + 64 + 65 + 40000, 6)


def test_the_text_is_prometheus_exposition_with_the_method_label():
    counts = WorkerCounts(compactions=3, evicted_tokens=90, freed_blocks=4, failed_requests=1, compact_s=0.5,
                          step_s=10.0, steps=7)
    counts.observe_kv([40, 100])
    text = prometheus_text(counts.as_dict(), 'ams:"tova"')
    label = 'method="ams:\\"tova\\""'
    lines = text.splitlines()
    for name, value in (("kvsieve_compactions_total", "3"), ("kvsieve_evicted_tokens_total", "90"),
                        ("kvsieve_freed_blocks_total", "4"), ("kvsieve_failed_requests_total", "1"),
                        ("kvsieve_compaction_seconds_total", "0.5"), ("kvsieve_step_seconds_total", "10.0")):
        at = lines.index(f"# TYPE {name} counter")
        assert lines[at - 1].startswith(f"# HELP {name} ") and lines[at + 1] == f"{name}{{{label}}} {value}"
    assert "# TYPE kvsieve_request_kv_tokens histogram" in lines
    buckets = [line for line in lines if line.startswith("kvsieve_request_kv_tokens_bucket")]
    assert buckets[:3] == [f'kvsieve_request_kv_tokens_bucket{{{label},le="32"}} 0',
                           f'kvsieve_request_kv_tokens_bucket{{{label},le="64"}} 1',
                           f'kvsieve_request_kv_tokens_bucket{{{label},le="128"}} 2']
    assert buckets[-1] == f'kvsieve_request_kv_tokens_bucket{{{label},le="+Inf"}} 2'  # cumulative
    assert f"kvsieve_request_kv_tokens_sum{{{label}}} 140" in lines
    assert f"kvsieve_request_kv_tokens_count{{{label}}} 2" in lines


class VLLMApp:
    """vLLM's app as the middleware sees it: its /metrics page (gzip when asked, as
    prometheus_client's app does), the headers it was asked with, and an engine client."""

    def __init__(self, engine_answer):
        self.seen_headers = []
        self.state = SimpleNamespace(
            vllm_config=SimpleNamespace(additional_config={"kvsieve": {"method": "streaming", "budget": 64}},
                                        model_config=SimpleNamespace(max_model_len=1024)),
            engine_client=SimpleNamespace(collective_rpc=engine_answer))

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", []))
        self.seen_headers.append(headers)
        body = b"vllm:num_requests_running 0\n"
        gzip = b"gzip" in headers.get(b"accept-encoding", b"")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
                    + ([(b"content-encoding", b"gzip")] if gzip else [])})
        await send({"type": "http.response.body", "body": body})


def scrape(app, path="/metrics", method="GET"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "app": app,
             "headers": [(b"accept-encoding", b"gzip, deflate")]}
    asyncio.run(SieveMetrics(app)(scope, receive, send))
    return dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:]).decode()


def test_metrics_are_vllms_page_then_kvsieves_uncompressed_with_the_length_right():
    counts = WorkerCounts(compactions=2)

    async def answer(method, timeout=None):
        assert method == "kvsieve_stats"
        return [counts.as_dict(), WorkerCounts(compactions=99).as_dict()]  # the first rank's are shown

    app = VLLMApp(answer)
    headers, body = scrape(app)
    assert body.startswith("vllm:num_requests_running 0\n")
    assert body[len("vllm:num_requests_running 0\n"):] == prometheus_text(counts.as_dict(), "streaming")
    assert int(headers[b"content-length"]) == len(body.encode())
    assert b"accept-encoding" not in app.seen_headers[0] and b"content-encoding" not in headers


def test_an_engine_that_does_not_answer_leaves_vllms_page_alone():
    async def answer(method, timeout=None):
        raise TimeoutError("engine busy")

    headers, body = scrape(VLLMApp(answer))
    assert body == "vllm:num_requests_running 0\n" and int(headers[b"content-length"]) == len(body)


def test_other_paths_go_to_vllm_untouched():
    async def answer(method, timeout=None):
        raise AssertionError("asked the engine for a page that is not /metrics")

    app = VLLMApp(answer)
    headers, body = scrape(app, path="/health")
    assert body == "vllm:num_requests_running 0\n" and headers[b"content-encoding"] == b"gzip"
