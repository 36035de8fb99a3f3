"""Pieces every benchmark shares: prompts, one timed generate call, machine facts, output."""

from __future__ import annotations

import json
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from ..generate import GenerateConfig, generate
from ..methods import make_policy
from ..random_models import RANDOM_NOTE, is_random

PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a mysterious map, "
          "describing every day of the journey that follows. Variant {i}.")


def load_for(settings):
    """Apply ``settings.threads`` and load ``(model, tokenizer)`` (``bench.settings.Settings``)."""
    from ..models import load_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    return load_model(settings.model, device=settings.device, dtype=settings.dtype)


@contextmanager
def profiled(path: str | None):
    """Profile the enclosed block with ``torch.profiler`` when ``path`` is set (``--profile``)."""
    if not path:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out))
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25)
    out.with_name(out.name + ".txt").write_text(table)
    print(table)
    print(f"wrote profiler trace {out} and {out.name}.txt")


def prompts(batch: int) -> list[str]:
    return [PROMPT.format(i=i) for i in range(batch)]


def timed_generate(model, tok, method: str, budget: int | None, batch: int, new_tokens: int,
                   kv_memory_gb: float | None = None, clock_every: int | None = None, compile: bool = False,
                   **settings) -> dict:
    """Greedy generation of exactly ``new_tokens`` per row (EOS ignored); batch-level figures.

    With ``clock_every`` the row also holds ``clock``: ``(tokens generated per row, seconds since
    the first decode check)`` at that first check and each time the rows pass a multiple of
    ``clock_every`` tokens, so one long run gives the speed over every stretch of the way
    (``tokens_per_s_between``).  Readings land on the host checks (every ``check_every`` steps).
    ``compile`` runs the compiled decode step; its compile time is ``compile_s``, apart from
    ``decode_s``, and the clock stops while a step compiles (an evicting step compiles its graph
    only when the cache first reaches the budget, far into a long run)."""
    policy = make_policy(method, budget=None if method == "full" else budget, **settings)
    config = GenerateConfig(max_new_tokens=new_tokens, ignore_eos=True, kv_memory_gb=kv_memory_gb, compile=compile)
    clock: list[tuple[int, float]] = []  # (tokens row 0 has generated, perf_counter)
    done = [0]

    def on_token(row: int, new_ids: list[int]) -> None:  # rows advance in lock step (EOS ignored)
        if row == 0:
            before, done[0] = done[0], done[0] + len(new_ids)
            if not clock or done[0] // clock_every > before // clock_every:
                clock.append((done[0], time.perf_counter()))

    t0 = time.perf_counter()
    result = generate(model, tok, prompts(batch), policy, config, on_token=on_token if clock_every else None)
    wall = time.perf_counter() - t0
    decode_s = max(s.decode_s for s in result.stats)
    generated = sum(s.generated_tokens for s in result.stats)
    return {
        "method": method, "budget": policy.budget, "batch": batch, "new_tokens": new_tokens,
        "compile": compile, "generated_tokens": generated, "wall_s": wall, "decode_s": decode_s,
        "compile_s": result.stats[0].compile_s,
        "decode_tokens_per_s": generated / decode_s,
        "peak_kv_bytes": max((b for _, b in result.kv_bytes_trace), default=0),
        "peak_kv_tokens_max_layer": max(max(s.peak_kv_tokens) for s in result.stats),
        "compression_events": result.stats[0].compression_events,
        "kv_bytes_trace": result.kv_bytes_trace,
        **({"clock": without_compiling(clock, result.compile_spans)} if clock else {}),
    }


def without_compiling(clock: list[tuple[int, float]], spans: list[tuple[float, float]]) -> list[tuple[int, float]]:
    """``clock`` readings ``(tokens, perf_counter)`` as ``(tokens, decode seconds since the first
    reading)``: each reading less the compile ``spans`` ``(perf_counter at its end, seconds)`` that
    ended before it, and less the first reading's such time."""
    def decoding(t: float) -> float:
        return t - sum(seconds for ended, seconds in spans if ended <= t)
    first = decoding(clock[0][1])
    return [(n, decoding(t) - first) for n, t in clock]


def tokens_per_s_between(row: dict, start: int, end: int) -> float:
    """Decode tokens/s (all rows) from ``start`` to ``end`` generated tokens, read off ``row["clock"]``.

    ``start`` is rounded up to the first clock reading (the first host check, a few steps in)."""
    marks = dict(row["clock"])
    first = min(n for n in marks if n >= start)
    if end not in marks:
        raise ValueError(f"no clock reading at {end} tokens; the run read it at {sorted(marks)}")
    return row["batch"] * (end - first) / (marks[end] - marks[first])


def machine(model) -> dict:
    facts = {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "device": str(model.device), "dtype": str(model.dtype)}
    if is_random(model):
        print(RANDOM_NOTE)
        facts["weights"] = RANDOM_NOTE
    return facts


def write(path: str, payload: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")
    return out


def report(args, benchmark: str, facts: dict, rows: list[dict], header: str, line, draw) -> None:
    """The end of a tokens/s benchmark run: the settings line, the table (``header``, then
    ``line(row)`` for each row), then its JSON at ``args.out`` and the PNG ``draw(ax, rows)``
    (``args``: the run's ``bench.settings`` dataclass)."""
    print(f"\n{args.model}, {args.new_tokens} new tokens, budget {args.budget}, {facts['device']}, "
          f"{facts['threads']} threads")
    print(header)
    for row in rows:
        print(line(row))
    out = write(args.out, {"benchmark": benchmark, "model": args.model, "machine": facts, "settings": asdict(args),
                           "rows": rows})
    plot(out, lambda ax: draw(ax, rows))


def plot(path: Path, draw, panels: int = 1) -> None:
    """Save a PNG beside ``path`` with ``draw(ax)`` (``draw(axes)`` for several side-by-side
    ``panels``); skipped (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(1, panels, figsize=(7 * panels, 4.5))
    draw(ax)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    plt.close(fig)
    print(f"wrote {path.with_suffix('.png')}")
