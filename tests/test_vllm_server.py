"""``kvsieve serve`` end to end (issue 49): vLLM's OpenAI server with ``streaming`` at budget 64 on
the bundled SmolLM2-135M (fp32, eager), driven over HTTP as a client would, and read back from
vLLM's own ``/metrics``.

Needs the vLLM environment (``make vllm-env``; ``make test-vllm`` runs this); skipped where vLLM
is not installed, so ``make test`` in the project's .venv does not run it.  The server runs in a
process group of its own, which the fixture's finalizer ends.
"""

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
requests = pytest.importorskip("requests")

BLOCK, POOL = 32, 40  # tokens per block; blocks in the pool (one of them is vLLM's null block)
# fp32 SmolLM2-135M: 30 layers x 3 kv heads x 64 dims x 2 (k, v) x 4 bytes per token.  An explicit
# KV size also spares vLLM's CPU start-up check of --gpu-memory-utilization against free memory.
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * BLOCK
BUDGET, INTERVAL = 64, 16
# A request at BUDGET grows to BUDGET + INTERVAL tokens between two compactions, and may hold one
# more block while a compaction's cut blocks wait for their step to end (docs/vllm-design.md).
BLOCKS_PER_REQUEST = math.ceil((BUDGET + INTERVAL) / BLOCK) + 1
START_TIMEOUT = 600  # s: the engine starts in about 30 s on a quiet machine, minutes on a busy one
MODEL_NAME = "smol"
PROMPT = "The history of the printing press begins"


def _model_dir() -> str:
    from kvsieve.models import checkpoint_dir

    path = checkpoint_dir("smollm2-135m")
    if path is None:
        pytest.skip("smollm2-135m is not converted: kvsieve models install smollm2-135m (make test-vllm does)")
    return str(path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen) -> None:
    """End the server's whole process group (API server, engine core, worker): SIGTERM, then
    SIGKILL what is left after 60 s; fail if any process of the group survives."""
    group = proc.pid
    for sig, grace in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
    pytest.fail(f"processes of group {group} outlived SIGKILL")


@contextlib.contextmanager
def running(argv: list[str], log: Path):
    """``kvsieve serve ARGV`` (its output in ``log``) until /health answers: its base URL; the
    server's whole process group is ended afterwards."""
    port = _free_port()
    argv = [sys.executable, "-m", "kvsieve.cli", "serve", *argv, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvsieve serve exited with {proc.returncode}:\n{_tail(log)}")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within {START_TIMEOUT} s:\n{_tail(log)}")
            time.sleep(2)
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The base URL of a running ``kvsieve serve``; its log is in the test's tmp directory."""
    _model_dir()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    argv = ["smollm2-135m", "--method", "streaming", "--budget", str(BUDGET), "--interval", str(INTERVAL),
            # the rest is vLLM's own: a small fixed pool, fp32, eager
            "--served-model-name", MODEL_NAME,
            "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
            "--kv-cache-memory-bytes", str(POOL * BLOCK_BYTES), "--num-gpu-blocks-override", str(POOL),
            "--max-model-len", "1024", "--max-num-seqs", "8",
            "--seed", "0"]
    with running(argv, log) as url:
        yield url


def metrics(url: str) -> dict[str, float]:
    """vLLM's gauges from ``/metrics`` (this server has one engine and one model: labels dropped),
    and ``finished:REASON``, its count of requests finished for each reason (stop, length, abort)."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    values = {}
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.match(r"^([\w:]+)(?:\{([^}]*)\})? (\S+)$", line)
        if not match:
            continue
        name, labels, value = match.groups()
        if name in names:
            values[name] = float(value)
        elif name == "vllm:request_success_total":
            reason = re.search(r'finished_reason="(\w+)"', labels).group(1)
            values[f"finished:{reason}"] = float(value)
    assert set(names) <= set(values), f"missing from /metrics: {set(names) - set(values)}"
    return values


GAUGES_IDLE = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0, "vllm:kv_cache_usage_perc": 0.0}


def stream(url: str, max_tokens: int, stop_after: int | None = None, on_tokens=None) -> dict:
    """One streaming completion, greedy and past EOS: ``{"tokens", "finish_reason"}``, the tokens
    counted by vLLM's per-chunk usage (a chunk may carry several tokens when the reader lags).
    ``on_tokens(n)`` is called after each chunk; with ``stop_after``, the connection is closed once
    that many tokens came (a client that goes away mid-stream)."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    tokens, finish = 0, None
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            tokens = chunk["usage"]["completion_tokens"]
            finish = next((c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]), finish)
            if on_tokens is not None:
                on_tokens(tokens)
            if stop_after is not None and tokens >= stop_after:
                break  # leaving the block closes the connection mid-stream
    return {"tokens": tokens, "finish_reason": finish}


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    """``metrics(url)`` once no request runs or waits and no block is held, or the last read."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        if all(values[name] == 0 for name in GAUGES_IDLE) or time.monotonic() > deadline:
            return values
        time.sleep(1)


def test_concurrent_streams_and_an_abort_give_every_block_back(server):
    """Four streams of 160 tokens and a fifth whose client leaves after 100 tokens, all compacted
    at budget 64 as they run: once they are done, nothing runs, waits or holds a block."""
    results: dict[str, dict] = {}
    before = metrics(server)

    def run(name, **kwargs):
        results[name] = stream(server, **kwargs)

    threads = [threading.Thread(target=run, args=(f"full-{i}",), kwargs={"max_tokens": 160}) for i in range(4)]
    threads.append(threading.Thread(target=run, args=("aborted",), kwargs={"max_tokens": 900, "stop_after": 100}))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    assert not any(thread.is_alive() for thread in threads)
    for i in range(4):
        assert results[f"full-{i}"] == {"tokens": 160, "finish_reason": "length"}
    # past the budget, so it was compacted (and held cut blocks) before it went away
    assert 100 <= results["aborted"]["tokens"] < 900 and results["aborted"]["finish_reason"] is None
    after = wait_idle(server)
    assert {name: after[name] for name in GAUGES_IDLE} == GAUGES_IDLE
    # The fifth request was aborted when its client went: it is neither running nor finished by
    # length (900 tokens) or stop.  (vLLM 0.32 counts no "abort" for a client that disconnects.)
    finished = {reason: after.get(f"finished:{reason}", 0) - before.get(f"finished:{reason}", 0)
                for reason in ("length", "stop")}
    assert finished == {"length": 4, "stop": 0}


def test_a_long_stream_holds_a_bounded_number_of_blocks(server):
    """600 tokens would fill 19 blocks of 32 without eviction; at budget 64 the request holds at
    most BLOCKS_PER_REQUEST of the pool's POOL - 1 usable blocks at any step, however long it runs."""
    samples: list[tuple[int, float]] = []  # (tokens generated, KV cache usage), every 25 tokens or so

    def sample(tokens):
        if not samples or tokens >= samples[-1][0] + 25:
            samples.append((tokens, metrics(server)["vllm:kv_cache_usage_perc"]))

    result = stream(server, max_tokens=600, on_tokens=sample)
    assert result == {"tokens": 600, "finish_reason": "length"}
    late = [usage for tokens, usage in samples if tokens >= 300]
    assert len(late) >= 5
    assert 0 < max(late) <= BLOCKS_PER_REQUEST / (POOL - 1), samples
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0.0


def test_a_model_that_is_not_there_is_one_line():
    result = subprocess.run([sys.executable, "-m", "kvsieve.cli", "serve", "./no-such-model",
                             "--method", "streaming", "--budget", "64"],
                            capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"}, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "model directory './no-such-model' does not exist" in result.stderr


def complete(url: str, max_tokens: int, vllm_xargs: dict | None = None) -> requests.Response:
    """One greedy completion past EOS, not streamed, with ``vllm_xargs`` (its ``extra_args``)."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if vllm_xargs is not None:
        body["vllm_xargs"] = vllm_xargs
    return requests.post(f"{url}/v1/completions", json=body, timeout=600)


@pytest.mark.parametrize("vllm_xargs, message", [
    ({"kvsieve_budgett": 32}, "kvsieve: unknown per-request setting 'kvsieve_budgett' (did you mean kvsieve_budget?)"),
    ({"kvsieve_budget": "32"}, "kvsieve: kvsieve_budget must be an integer, got '32' (str)"),
    ({"kvsieve_budget": True}, "kvsieve: kvsieve_budget must be an integer, got True (bool)"),  # the gate sees JSON
])
def test_a_bad_per_request_setting_is_http_400_before_it_is_queued(server, vllm_xargs, message):
    resp = complete(server, 8, vllm_xargs)
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text


def test_per_request_settings_run_or_are_refused_alone(server):
    """A request with its own budget runs to the end; one whose settings do not fit the server's
    method (a recent window above its budget) is answered by the HTTP gate with a 400 and the
    reason, alone, and the server goes on: nothing runs, waits or holds a block after."""
    own = complete(server, 96, {"kvsieve_budget": 32})
    assert own.status_code == 200 and own.json()["usage"]["completion_tokens"] == 96, own.text
    refused = complete(server, 96, {"kvsieve_recent": 100})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"] == (
        f"kvsieve: streaming: budget {BUDGET} is smaller than the protected tokens: sinks 4 + recent 100; raise "
        "kvsieve_budget to at least 104 or lower sinks/recent")
    assert {name: wait_idle(server)[name] for name in GAUGES_IDLE} == GAUGES_IDLE


def kvsieve_series(url: str) -> dict[str, float]:
    """kvsieve's series on the server's /metrics, by name and labels."""
    page = requests.get(f"{url}/metrics", timeout=30).text
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in page.splitlines() if line.startswith("kvsieve_"))}


def test_metrics_show_the_compactions_a_request_had(server):
    """/metrics carries kvsieve's series beside vLLM's, labelled with the method, and one request's
    counts are what the schedule gives by hand: StreamingLLM at budget BUDGET every INTERVAL decode
    steps compacts a request holding more than BUDGET tokens down to BUDGET, evicting the rest and
    giving back the blocks beyond the BUDGET + 1 tokens it keeps (its next token included)."""
    label = '{method="streaming"}'
    before = kvsieve_series(server)
    assert f"kvsieve_compactions_total{label}" in before and "vllm:num_requests_running" not in before
    done = complete(server, 96)
    assert done.status_code == 200, done.text
    prompt = done.json()["usage"]["prompt_tokens"]
    compactions = evicted = freed = offset = 0
    for logical in range(prompt + 1, prompt + 96 - 1):  # the KV length checked before each decode step
        held = logical - offset
        if (logical - prompt) % INTERVAL == 0 and held > BUDGET:
            compactions, evicted = compactions + 1, evicted + held - BUDGET
            freed += -(-held // BLOCK) - -(-(BUDGET + 1) // BLOCK)
            offset = logical - BUDGET
    after = kvsieve_series(server)
    assert compactions >= 2
    for name, expected in (("compactions", compactions), ("evicted_tokens", evicted), ("freed_blocks", freed)):
        key = f"kvsieve_{name}_total{label}"
        assert after[key] - before[key] == expected, name
    count = 'kvsieve_request_kv_tokens_count{method="streaming"}'
    assert after[count] - before[count] == 96  # scheduled once per new token: the prefill, then 95 steps


@pytest.mark.slow
def test_a_tensor_parallel_server_gives_one_workers_text(tmp_path):
    """``kvsieve serve -tp 2`` on Qwen2.5-Coder-0.5B (one kv head per worker), H2O at budget 64,
    with no binding given: kvsieve serve binds each worker to a core of its own (vLLM's default
    would assert on one NUMA node), and the greedy completions equal those of ``-tp 1``."""
    from kvsieve.models import checkpoint_dir

    if len(os.sched_getaffinity(0)) < 2 or checkpoint_dir("qwen2.5-coder-0.5b") is None:
        pytest.skip("needs two cores and qwen2.5-coder-0.5b (make test-vllm installs it)")
    prompts = ["def fibonacci(n):", "class Stack:"]
    texts = {}
    for tp in (2, 1):
        argv = ["qwen2.5-coder-0.5b", "--method", "h2o", "--budget", "64", "--served-model-name", MODEL_NAME,
                "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "512",
                "--max-num-seqs", "2", "--kv-cache-memory-bytes", str(64 << 20), "-tp", str(tp)]
        env_before = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        try:
            with running(argv, tmp_path / f"tp{tp}.log") as url:
                texts[tp] = [requests.post(f"{url}/v1/completions", timeout=600, json={
                    "model": MODEL_NAME, "prompt": p, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                }).json()["choices"][0]["text"] for p in prompts]
                compactions = kvsieve_series(url).get('kvsieve_compactions_total{method="h2o"}', 0)
        finally:
            if env_before is not None:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = env_before
        assert compactions > 0, tp
    assert "binding them to cores" in (tmp_path / "tp2.log").read_text(errors="replace")
    assert texts[2] == texts[1]
