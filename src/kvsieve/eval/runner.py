"""The grid runner: every (method, budget) cell over the samples, one durable row per sample.

``run_grid(config)`` loads the data set, keeps this shard's samples, and for each cell (``full``
first) decodes the samples not yet in the results directory in batches of ``batch_size``,
and grades and appends each sample's row as soon as that sample ends (a sample that stops early
is stored while its batch goes on).  Restarting the same command resumes where it stopped.
``run_batch`` is the unit of work shared with the Ray backend.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, Iterable, TextIO

from ..checks import InputError
from ..data import Sample, load_dataset
from ..grading import grade
from .config import Cell, EvalConfig, split_steer
from .store import ResultStore, check_manifest

RowCallback = Callable[[dict[str, Any]], None]


def shard_samples(samples: list[Sample], shard: tuple[int, int]) -> list[Sample]:
    """Round-robin split (sample i goes to shard i mod n), so shards get similar difficulty mixes."""
    index, count = shard
    return samples[index::count]


def load_samples(config: EvalConfig) -> list[Sample]:
    limit = None if config.limit is None else config.skip + config.limit
    samples = load_dataset(config.dataset, path=config.data_path, limit=limit, seed=config.seed,
                           **config.data_options)
    if config.skip and config.skip >= len(samples):
        raise ValueError(f"--skip {config.skip} passes over all {len(samples)} samples of {config.dataset}; "
                         "lower --skip")
    kept = samples[config.skip:]
    mine = shard_samples(kept, config.shard)
    if not mine:
        index, count = config.shard
        raise ValueError(f"--shard {index}/{count} holds none of the {len(kept)} samples of {config.dataset}: "
                         f"nothing to run; use at most {len(kept)} shards")
    return mine


def make_cell_policy(config: EvalConfig, cell: Cell):
    """The cell's eviction policy (a ``+steer`` label runs its method's policy)."""
    from ..methods import make_policy

    label, budget = cell
    method = split_steer(label)[0]
    if method == "full":
        return make_policy("full")
    return make_policy(method, budget=budget, **config.settings.get(label, {}))


def load_steering_vector(config: EvalConfig):
    """The grid's steering vector (read once, unchecked), or None when no cell is steered."""
    from ..steering import SteeringVector

    return None if config.steering is None else SteeringVector.read(config.steering)


def make_steering(config: EvalConfig, model, vector=None):
    """The grid's ``Steering`` for ``model``: ``vector`` (or the file) checked against the model;
    raises ``SteeringModelError`` naming both models when it was built for another one."""
    from ..steering import Steering

    vector = vector if vector is not None else load_steering_vector(config)
    return None if vector is None else Steering.preset(vector.check(model, config.steering), **config.steering_settings)


def _kv_heads(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def prompt_digest(sample: Sample) -> str:
    """A short hash of what the model is given and graded against (messages, reference, and a
    perplexity sample's text), so a resumed run can tell that an id now names another prompt."""
    content = [sample.messages, sample.reference, sample.metadata.get("text")]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def check_prompts(config: EvalConfig, samples: list[Sample], stored: dict[str, str]) -> None:
    """Refuse a grid whose samples' prompts differ from the ones its stored rows ran on (an edited
    data file, a changed template or generated set): resumed, the rows would mix two prompts under
    one id; finished, its table would stand for data it was not made from.  The choice is the
    user's: another ``--out`` runs the grid on the data as it is now, the data the rows were made
    from adds to them.  Rows written before rows carried ``prompt_sha256`` are not checked."""
    changed = [s.id for s in samples if s.id in stored and stored[s.id] != prompt_digest(s)]
    if changed:
        raise InputError(f"{config.out} has rows for sample(s) {', '.join(changed[:5])}"
                         f"{' ...' if len(changed) > 5 else ''} whose prompt or reference has changed since "
                         "(data file, prompt template or generated data set); use another --out directory to run "
                         "them as they are now, or the data the rows were made from")


def _base_row(config: EvalConfig, cell: Cell, sample: Sample, settings: dict, kv_heads: int) -> dict[str, Any]:
    return {"id": sample.id, "dataset": config.dataset, "model": config.model, "method": cell[0], "budget": cell[1],
            "settings": settings, "reference": sample.reference, "grader": sample.grader, "kv_heads": kv_heads,
            "prompt_sha256": prompt_digest(sample), "model_fingerprint": config.model_fingerprint}


def _runtime(model) -> dict[str, Any]:
    """Where a row was computed.  Greedy text can depend on rounding (thread count, device, library
    versions), most at small budgets where generations degenerate, so rows say what produced them."""
    import torch
    import transformers

    param = next(model.parameters())
    return {"device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def _layer_mean(per_layer: list[int]) -> float:
    """Live KV tokens averaged over layers: the cache a method holds when layers differ (Knorm's
    uncompressed first layers, a pyramid allocator), where the largest layer overstates it."""
    return round(sum(per_layer) / len(per_layer), 2) if per_layer else 0.0


def _stat_fields(stat) -> dict[str, Any]:
    return {
        "prompt_tokens": stat.prompt_tokens, "generated_tokens": stat.generated_tokens,
        "finish_reason": stat.finish_reason, "peak_kv_tokens": max(stat.peak_kv_tokens, default=0),
        "steady_peak_kv_tokens": max(stat.steady_peak_kv_tokens, default=0),
        "final_kv_tokens": max(stat.final_kv_tokens, default=0), "final_kv_tokens_mean": _layer_mean(stat.final_kv_tokens),
        "peak_kv_bytes": stat.peak_kv_bytes,
        "tokens_per_s": round(stat.tokens_per_s, 3), "prefill_s": round(stat.prefill_s, 4),
        "decode_s": round(stat.decode_s, 4), "compression_events": stat.compression_events,
    }


def run_batch(model, tokenizer, config: EvalConfig, cell: Cell, samples: list[Sample],
              steering=None, on_row: RowCallback | None = None,
              on_tokens: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Decode (or score) ``samples`` under ``cell``'s policy and return one graded row each.

    ``on_row(row)`` gets each row as soon as its sample is done (a sample that stops early is
    not held back until the whole batch has decoded), so the caller can store it at once.
    ``on_tokens(n)`` is told of the tokens generated as the batch decodes (``n`` new ones at a
    time, every few steps): progress while no row has ended yet.

    A steered cell (``<method>+steer``) decodes with ``steering`` (``make_steering``; built from
    ``config.steering`` when not given); other cells never steer."""
    policy = make_cell_policy(config, cell)
    steered = split_steer(cell[0])[1]
    kv_heads = _kv_heads(model)
    runtime = _runtime(model)
    if samples and samples[0].grader == "perplexity":
        if steered:
            raise ValueError(f"{cell[0]}: steering applies to generation, not to perplexity scoring; "
                             f"drop the +steer methods for data set {config.dataset!r}")
        rows = []
        for sample in samples:
            rows.append({**_perplexity_row(model, tokenizer, config, cell, policy, sample, kv_heads),
                         "runtime": runtime})
            if on_row is not None:
                on_row(rows[-1])
        return rows
    from ..generate import generate

    if steered and steering is None:
        steering = make_steering(config, model)
    gen_config = config.generate_config()
    rows: dict[int, dict[str, Any]] = {}

    def finished(index: int, text: str, stat, settings: dict) -> None:
        sample = samples[index]
        graded = grade(sample.grader, text, sample.reference, truncated=stat.finish_reason == "length")
        rows[index] = {**_base_row(config, cell, sample, settings, kv_heads), **_stat_fields(stat),
                       "batch_size": len(samples), "text": text, "extracted": graded.extracted,
                       "correct": graded.correct, "runtime": runtime}
        if on_row is not None:
            on_row(rows[index])

    streamed = None if on_tokens is None else lambda row, ids: on_tokens(len(ids))
    generate(model, tokenizer, [s.messages for s in samples], policy, gen_config, on_token=streamed,
             hooks=[steering] if steered else [], on_finish=finished)
    return [rows[i] for i in range(len(samples))]


def _perplexity_row(model, tokenizer, config, cell, policy, sample: Sample, kv_heads: int) -> dict[str, Any]:
    from .perplexity import score_text

    score = score_text(model, tokenizer, sample.metadata["text"], policy)
    return {**_base_row(config, cell, sample, policy.settings(), kv_heads),
            "prompt_tokens": score.prompt_tokens, "generated_tokens": 0, "scored_tokens": score.scored_tokens,
            "nll": score.nll, "perplexity": score.perplexity, "peak_kv_tokens": max(score.peak_kv_tokens, default=0),
            "final_kv_tokens": max(score.final_kv_tokens, default=0),
            "final_kv_tokens_mean": _layer_mean(score.final_kv_tokens), "peak_kv_bytes": score.peak_kv_bytes,
            "compression_events": score.compression_events,
            "tokens_per_s": round(score.scored_tokens / score.seconds, 3) if score.seconds else 0.0,
            "batch_size": 1, "text": "", "extracted": None, "correct": None}


def check_run_manifest(config: EvalConfig) -> None:
    """Record the grid's settings in ``run.json``, or refuse to add rows produced under others
    (``check_manifest``; settings typed differently that run each method the same are no change)."""
    check_manifest(config.out, config.result_fields(), same=config.same_settings)


def pending_work(config: EvalConfig, samples: list[Sample], done: set) -> list[tuple[Cell, list[Sample]]]:
    """(cell, samples to run) for every cell, ``full`` first (on the first ``reference_limit`` samples
    only, when set); finished keys are left out."""
    def of(cell: Cell) -> list[Sample]:
        return samples[:config.reference_limit] if cell[0] == "full" and config.reference_limit else samples

    return [(cell, [s for s in of(cell) if (s.id, cell[0], cell[1]) not in done]) for cell in config.cells()]


def check_cell_settings(config: EvalConfig, cell_settings: dict[Cell, dict], work) -> None:
    """Refuse to add rows to a cell whose rows so far ran under other policy settings.

    ``run.json`` holds the settings the user passed; a method's *defaults* can change between
    versions of kvsieve (Knorm's ``skip_layers``), and resuming would then average two different
    methods under one label.  Every setting of the cell's policy now is compared with the first
    existing row's ``settings`` (``cell_settings``, as ``ResultStore`` read them); the fields a
    self-sizing method fits per batch (``fitted_fields``) are left out.  A field added since then
    counts as changed (its value was absent).
    """
    changed = []
    for cell, pending in work:
        if not pending or cell not in cell_settings:
            continue
        policy = make_cell_policy(config, cell)
        now = json.loads(json.dumps(policy.settings()))  # tuples as the rows store them
        fitted = policy.scorer.needs.fitted_fields if policy.scorer is not None else ()
        keys = [k for k in now if k not in fitted and cell_settings[cell].get(k) != now[k]]
        changed += [f"{cell_label(cell)} {k}: {cell_settings[cell].get(k)!r} before, {now[k]!r} now" for k in keys]
    if changed:
        raise InputError(f"{config.out} has rows of cells whose method settings have changed since "
                         f"({'; '.join(changed)}); delete those cells' rows to rerun them under the new "
                         "settings, or use another --out directory")


def batches(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def cell_label(cell: Cell) -> str:
    return cell[0] if cell[1] is None else f"{cell[0]}@{cell[1]}"


LOG_EVERY = 60.0  # seconds between LogLines' lines at most


class Bars:
    """Progress of a grid on a terminal: a rich bar per cell with its ETA."""

    def __init__(self, work: list[tuple[Cell, list[Sample]]], samples: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.bar = Progress(TextColumn("[bold]{task.description:>18}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        self.tasks = {cell: self.bar.add_task(cell_label(cell), total=samples, completed=samples - len(pending))
                      for cell, pending in work}

    def start(self, cell: Cell) -> None:
        pass

    def tokens(self, count: int) -> None:
        pass

    def rows(self, cell: Cell, count: int) -> None:
        self.bar.advance(self.tasks[cell], count)

    def __enter__(self) -> "Bars":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)


class LogLines:
    """Progress of a grid where stderr is no terminal (a log file, a pipe), where bars would stay
    silent until the end: one line at least every ``every`` seconds while the grid runs (a timer
    thread; a batch of 40 long answers writes no row for many minutes), and one as each cell starts:
    the cell, its rows done of its rows, the rows of the whole grid, the tokens per second generated
    in this run and the time left.  The time left is the rows left at the pace of the rows done in
    this run; before the first row ends, at most the rows left times ``max_new_tokens`` at the
    token rate (rows may stop early)."""

    def __init__(self, work: list[tuple[Cell, list[Sample]]], samples: int, max_new_tokens: int,
                 stream: TextIO | None = None, every: float = LOG_EVERY, clock: Callable[[], float] = time.monotonic):
        self.samples, self.max_new_tokens, self.every, self.clock = samples, max_new_tokens, every, clock
        self.stream = stream if stream is not None else sys.stderr
        self.cell_done = {cell: samples - len(pending) for cell, pending in work}
        self.total, self.done = samples * len(work), sum(self.cell_done.values())
        self.rows_now, self.tokens_now = 0, 0  # rows and tokens of this run
        self.cell: Cell | None = None
        self.began = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kvsieve-eval-progress", daemon=True)

    def start(self, cell: Cell) -> None:
        self.cell = cell
        self.print()

    def tokens(self, count: int) -> None:
        self.tokens_now += count

    def rows(self, cell: Cell, count: int) -> None:
        self.cell_done[cell] += count
        self.done += count
        self.rows_now += count

    def line(self) -> str:
        seconds = max(self.clock() - self.began, 1e-9)
        rate = self.tokens_now / seconds
        left = self.total - self.done
        if self.rows_now:
            eta = f"about {_duration(left * seconds / self.rows_now)} left"
        elif rate > 0:
            eta = f"at most {_duration(left * self.max_new_tokens / rate)} left"
        else:
            eta = "time left not known yet"
        cell = "" if self.cell is None else f"{cell_label(self.cell)} {self.cell_done[self.cell]}/{self.samples} rows, "
        return f"eval: {cell}all cells {self.done}/{self.total} rows, {rate:.1f} tokens/s, {eta}"

    def print(self) -> None:
        print(self.line(), file=self.stream, flush=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self.print()

    def __enter__(self) -> "LogLines":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self.print()


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{seconds:.0f} s" if seconds < 90 else f"{minutes} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def progress_reporter(enabled: bool, work, samples: int, config: EvalConfig) -> "Bars | LogLines | nullcontext":
    """Bars on a terminal, log lines elsewhere (``LogLines``), nothing when not ``enabled``."""
    if not enabled:
        return nullcontext(None)
    if sys.stderr.isatty():
        return Bars(work, samples)
    return LogLines(work, samples, config.max_new_tokens, every=LOG_EVERY)


def run_grid(config: EvalConfig, model=None, tokenizer=None, progress: bool = True, use_ray: bool = False,
             ray_address: str | None = None, ray_init: dict | None = None, ray_gpus: float | None = None,
             on_row: RowCallback | None = None) -> ResultStore:
    """Run (or resume) the grid; returns the closed store (``store.path`` is this process's file).

    ``model``/``tokenizer`` skip loading (tests, notebooks; with ``use_ray`` the workers load
    their own).  ``ray_address``/``ray_init`` go to ``ray.init``.  ``on_row`` is called after
    each row is durably written.
    """
    samples = load_samples(config)
    check_run_manifest(config)
    with ResultStore(config.out, config.results_name) as store:
        work = pending_work(config, samples, store.done)
        # a finished grid too: its table would otherwise stand for data it was not made from
        check_prompts(config, samples, store.prompts)
        todo = sum(len(s) for _, s in work)
        if todo == 0:
            return store
        check_cell_settings(config, store.cell_settings, work)
        if model is None and not use_ray:
            from ..models import load_model

            model, tokenizer = load_model(config.model, device=config.device, dtype=config.dtype)
        steering = None
        if not use_ray and any(split_steer(cell[0])[1] and pending for cell, pending in work):
            steering = make_steering(config, model)  # another model's vector fails here, before any batch
        with progress_reporter(progress, work, len(samples), config) as report:

            def write(cell: Cell, rows: list[dict[str, Any]]) -> None:
                for row in rows:
                    row["time"] = round(time.time(), 3)
                    if store.append(row) and on_row is not None:
                        on_row(row)
                if report is not None:
                    report.rows(cell, len(rows))

            if use_ray:
                from .ray_backend import run_on_ray

                run_on_ray(config, work, write, address=ray_address, num_gpus=ray_gpus, init=ray_init)
            else:
                tokens = None if report is None else report.tokens
                for cell, pending in work:
                    if pending and report is not None:
                        report.start(cell)
                    for batch in batches(pending, config.batch_size):  # rows stored as each sample ends
                        run_batch(model, tokenizer, config, cell, batch, steering,
                                  on_row=lambda row, cell=cell: write(cell, [row]), on_tokens=tokens)
    return store
