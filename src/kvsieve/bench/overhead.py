"""Per-step cost of every policy: decode time per token with the policy vs ``full`` at the
same live cache length, so the ratio isolates scoring + compaction (and, for methods that
observe attention every step, the explicit attention rows they need).

Every cache is filled through a decode session, as ``generate`` fills it: a prompt of ``length``
random token ids (decode speed does not depend on which), prefilled (``filled_session``), with the
prompt competing for the budget as generated tokens do; each timed step runs one real forward pass
of the model on one token per row, then the policy's compression (its budget is ``length``, so
every step evicts exactly what the step appended; methods compressing every ``interval`` steps are
charged one timed compression over ``interval`` steps, see ``time_method``). ``full`` runs the same
forward pass over the same length without compressing, step for step with the method (paired,
alternating which goes first), and each figure is a median over steps, so a shared machine's
drift hits both sides of a ratio alike.  With ``--rounds R`` each method gets R paired runs
and the run with the median ratio is reported.

    kvsieve bench overhead --model smollm2-135m --lengths 512,2048 --batches 1,8

With ``--budget B`` the policies instead hold B tokens while ``full`` holds ``length``: the
same timed steps then give the decode rate of a bounded cache once ``length`` tokens exist
vs a full cache of that length (tokens/s ratio = full's ms/step over the policy's).

    kvsieve bench overhead --model smollm2-135m --lengths 8192 --batches 8 --budget 256 --methods tova
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from typing import NamedTuple

import torch

from kvsieve import make_policy
from kvsieve.attention import ATTN_IMPLEMENTATION
from kvsieve.bench.common import machine, plot, profiled, write
from kvsieve.bench.settings import OverheadSettings, names, numbers
from kvsieve.methods import method_names
from kvsieve.policy import SCORERS
from kvsieve.session import DecodeSession


# The wrapped methods of the seed papers (CAOTE Sec. 4, AMS Table 2), timed by default beside
# every registered scorer
PAPER_WRAPPED = ("caote:tova", "fastcaote:tova", "caote:h2o", "ams:tova", "ams:expected", "ams:rkv")


def filled_session(model, policy, batch: int, length: int, steps: int, compile: bool = False) -> DecodeSession:
    """A decode session whose every layer holds the prompt of ``length`` random token ids, filled
    through the session itself (``DecodeSession.prefill``: real K/V, positions 0 .. length - 1,
    recent queries, scaling and the end-of-prompt schedule), with room for ``steps`` more tokens
    and one compression interval, so no timed step pays a growth.  A policy at budget ``length``
    keeps every token; a self-sizing one (LagKV) compresses the prompt into its partitions."""
    interval = policy.interval if policy.scorer is not None else 1
    session = DecodeSession(model, policy, batch_size=batch, horizon=length + 2 * max(steps + 2, interval),
                            compile=compile)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (batch, length), generator=g).to(model.device)
    session.prefill(ids, torch.arange(length, device=model.device).expand(batch, length))
    return session


def decode_untimed(session: DecodeSession, count: int) -> None:
    """``count`` decode steps that append one token per row each and compress nothing after the
    pass (``step(compress=False)``): the cache grows as in generation."""
    token = torch.zeros(len(session.slots), dtype=torch.long, device=session.device)
    for _ in range(count):
        session.step(token, compress=False)


class _Timed:
    """One method's filled session and its decode step, run exactly as ``generate`` runs it.

    ``lead`` untimed warm-up steps follow the prefill: a cache that grows while decoding (``full``,
    interval methods) is prefilled with ``lead`` fewer tokens, so it holds ``held`` when the timed
    steps begin without a second prefill (at 2048 tokens, batch 8, one prefill of the 0.5B takes
    minutes on this CPU)."""

    def __init__(self, model, method: str, batch: int, length: int, steps: int, budget: int | None,
                 compile: bool = False, settings: dict | None = None, lead: int = 0):
        self.model, self.batch, self.steps, self.compile = model, batch, steps, compile
        self.held = length if budget is None or method == "full" else budget
        settings = {**({"window": 16} if method == "lazy" else {}), **(settings or {})}
        budgeted = method == "full" or SCORERS[method.split(":")[-1]].needs.uses_budget
        if budgeted and method != "full":
            # the filled tokens stand for generated ones, which compete for the budget (a protected
            # prompt would be kept whole and the method would never compress)
            settings["protect_prompt"] = False
        self.policy = make_policy(method, budget=None if method == "full" or not budgeted else self.held, **settings)
        self.interval = self.policy.interval if self.policy.scorer else 1
        grows = self.interval > 1 or self.policy.scorer is None  # appends without evicting between compressions
        self.filled = self.held - (lead if grows else 0)  # prompt tokens prefilled
        self.partitions = not budgeted  # LagKV: frozen partitions + a tail, compressed every L tokens
        if self.partitions:  # a prompt its own compression leaves in steady state at ``length`` live tokens
            # (warmed up on it, then refilled: ``time_method`` resets it before the timed steps)
            self.filled, self.interval = lag_steady_state(self.policy.scorer, length), self.policy.scorer.lag
        self.token = torch.zeros(batch, dtype=torch.long, device=model.device)
        self.reset()

    def reset(self) -> None:
        """A fresh session holding ``held`` tokens (allocated once for all the timed steps)."""
        self.session = filled_session(self.model, self.policy, self.batch, self.filled, self.steps + 4, self.compile)

    def step(self) -> float:
        """Seconds of one decode step: the forward pass, then an every-step method's eviction
        (inside the step for in-place evictors, else after it); an interval method's compression
        is timed apart (``compression``)."""
        _sync(self.model)
        t0 = time.perf_counter()
        self.session.step(self.token, compress=self.interval == 1)
        _sync(self.model)
        return time.perf_counter() - t0

    def compression(self) -> float:
        """Seconds of one compression from ``held + interval`` tokens (the faster of two)."""
        best = float("inf")
        cache = self.session.cache
        for _ in range(2):  # the first one warms up
            live = cache.layers[0].live().sum(-1).max().item()
            if self.partitions:  # LagKV: up to the tail's second full partition
                count = lag_tokens_until_due(self.policy.scorer, int(cache.seen_tokens[0]), live)
            else:
                count = self.held + self.interval - live
            decode_untimed(self.session, count)
            _sync(self.model)
            t0 = time.perf_counter()
            self.session.schedule.compress()
            _sync(self.model)
            best = min(best, time.perf_counter() - t0)
        return best


class StepTimes(NamedTuple):
    """Seconds per decode step of a method and of ``full`` (paired), and of one compression of the
    method (charged 1/interval per step in ``ours``; 0.0 for an every-step method, whose eviction is
    in its step, and for ``full``)."""

    ours: float
    full: float
    compression: float


@torch.inference_mode()
def time_method(model, method: str, batch: int, length: int, steps: int,
                budget: int | None = None, compile: bool = False, settings: dict | None = None) -> StepTimes:
    """Seconds per decode step of ``method`` and of ``full``, measured in pairs (``StepTimes``).

    The two run step for step, alternating which goes first, each on its own cache, and each
    figure is the median over the steps, so drift on a shared machine hits both alike.
    ``full`` holds ``length`` tokens; the method holds ``budget`` (default ``length``) after
    ``length`` tokens were seen.  Every-step methods (interval 1) compress on every timed step.
    Interval methods (SnapKV 64, SkipKV 128, AMS 512, ...) time min(steps, I) forward steps
    (their per-step observation included); the cache is then filled to budget + I by untimed
    decode steps, and one timed compression is charged 1/I per step.  A scorer that
    observes only the step before a compression (TOVA inside AMS) runs unobserved timed steps;
    its one observed step per interval (about tova's per-step extra, divided by I) is not timed.
    LagKV and its variants (no token budget) run at their defaults in steady state
    (``lag_steady_state``): ``length`` live tokens, all but a tail of L to L + k - 1 in frozen
    partitions, one compression per L steps; with ``budget`` set they are not timed (nan, nan).
    """
    if budget is not None and method != "full" and not SCORERS[method.split(":")[-1]].needs.uses_budget:
        return StepTimes(float("nan"), float("nan"), float("nan"))
    warmup = 3 if compile else 2  # untimed steps (compiling, with --compile)
    full = _Timed(model, "full", batch, length, steps, None, compile, lead=warmup)
    ours = None if method == "full" else _Timed(model, method, batch, length, steps, budget, compile, settings,
                                                lead=warmup)
    runners = [r for r in (full, ours) if r is not None]
    for _ in range(warmup):
        for r in runners:
            r.step()
    n = steps if ours is None or ours.interval == 1 else min(steps, ours.interval)
    for r in runners:
        if r.partitions:  # back to LagKV's steady state for the timed steps
            r.reset()
    times = {id(r): [] for r in runners}
    for i in range(n):
        for r in (runners if i % 2 == 0 else runners[::-1]):
            times[id(r)].append(r.step())
    full_s = statistics.median(times[id(full)])
    if ours is None:
        return StepTimes(full_s, full_s, 0.0)
    ours_s = statistics.median(times[id(ours)])
    compression = ours.compression() if ours.interval > 1 else 0.0
    return StepTimes(ours_s + compression / ours.interval, full_s, compression)


def lag_steady_state(scorer, length: int) -> int:
    """Seen tokens at which a LagKV-style cache of ``length`` live tokens is in steady state:
    S sinks, p frozen partitions of k tokens and a tail of L to L + k - 1 tokens, so L more
    steps at most complete the next partition.  ``_lag.find_tail`` reads p from seen - live, so
    a prompt of this many tokens, compressed by LagKV itself after prefill, is that state."""
    S, L, k = scorer.sinks, scorer.lag, scorer.kept
    frozen = (length - S - L) // k
    if frozen < 1 or k >= L:
        raise ValueError(f"{scorer.name}: {length} live tokens leave no frozen partition "
                         f"(S={S}, L={L}, k={k}); use a length of at least {S + L + k}")
    return S + frozen * L + (length - S - frozen * k)


def lag_tokens_until_due(scorer, seen: int, live: int) -> int:
    """Appends until the tail holds two full partitions (the next LagKV compression)."""
    frozen = (seen - live) // (scorer.lag - scorer.kept)
    return max(2 * scorer.lag - (seen - scorer.sinks - frozen * scorer.lag), 0)


def _sync(model):
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def run(model, tok, args: OverheadSettings) -> list[dict]:
    """Every method's paired timing at every batch and length (the tokenizer is not needed: the
    prompts are random ids); writes JSON and PNG."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with profiled(args.profile):
            rows = measure(model, args)
    finally:
        model.set_attn_implementation(previous)
    out = write(args.out, {"benchmark": "overhead", "model": args.model, "machine": machine(model),
                           "settings": asdict(args), "rows": rows})
    plot(out, lambda ax: draw(ax, rows))
    return rows


def draw(ax, rows: list[dict]) -> None:
    """Horizontal bars: each method's per-step overhead vs full (or its speed-up with --budget),
    one bar per (length, batch); the issue's 10% line for overheads."""
    settings = sorted({(r["length"], r["batch"]) for r in rows})
    methods = sorted({r["method"] for r in rows}, key=lambda m: min(r["overhead_vs_full"] for r in rows if r["method"] == m))
    speedup = any(r.get("budget") for r in rows)
    height = 0.8 / len(settings)
    for i, (length, batch) in enumerate(settings):
        by_method = {r["method"]: r for r in rows if (r["length"], r["batch"]) == (length, batch)}
        values = [(by_method[m]["speedup_vs_full"] if speedup else by_method[m]["overhead_vs_full"] * 100)
                  if m in by_method else 0.0 for m in methods]
        ax.barh([j + i * height for j in range(len(methods))], values, height=height,
                label=f"{length} tokens, batch {batch}")
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(methods))], methods, fontsize=7)
    if speedup:
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("decode tokens/s vs full (policy holds --budget tokens, full the length)")
    else:
        ax.axvline(10, color="red", linestyle=":", label="10% target")
        ax.set_xlabel("per-step overhead vs full at the same cache length (%)")
    ax.legend(fontsize=7)


CALIBRATED = ("triattention",)  # methods that read a per-model statistics file (``--stats``)


def measure(model, args: OverheadSettings) -> list[dict]:
    methods = names(args.methods) if args.methods else [*method_names(), *PAPER_WRAPPED]
    rows = []
    calibrated = {"stats": args.stats} if args.stats else None
    for batch in numbers(args.batches):
        for length in numbers(args.lengths):
            print(f"batch {batch} length {length}:", flush=True)
            for method in [m for m in methods if m != "full"]:
                needs_stats = method.split(":")[-1] in CALIBRATED
                if needs_stats and calibrated is None:
                    print(f"  {method:14s} not timed: needs --stats FILE (kvsieve calibrate triattention)", flush=True)
                    continue
                pairs = [time_method(model, method, batch, length, args.steps, args.budget, args.compile,
                                     calibrated if needs_stats else None) for _ in range(args.rounds)]
                if math.isnan(pairs[0].ours):
                    print(f"  {method:14s} not timed: no token budget to hold the length at", flush=True)
                    continue
                ours, full, compression = sorted(pairs, key=lambda p: p.ours / p.full)[(len(pairs) - 1) // 2]  # median ratio
                overhead = ours / full - 1
                rows.append({"batch": batch, "length": length, "budget": args.budget, "method": method,
                             "ms_per_step": ours * 1e3, "full_ms_per_step": full * 1e3,
                             "overhead_vs_full": overhead, "speedup_vs_full": full / ours,
                             "compression_ms": compression * 1e3})
                versus = (f"overhead {overhead * 100:+6.1f}%" if args.budget is None
                          else f"{full / ours:5.2f}x full's tokens/s (holding {args.budget} of {length} tokens)")
                once = f"; one compression {compression * 1e3:.0f} ms" if compression else ""
                print(f"  {method:14s} {ours * 1e3:8.1f} ms/step vs full {full * 1e3:8.1f} (paired)  {versus}{once}",
                      flush=True)
    return rows

