"""CLI commands of the evaluation harness: ``eval``, ``report``, ``regrade`` and ``analyze trace``.

``register(app)`` adds them to a typer app (the ``kvsieve`` command).  ``trace`` joins an existing
``analyze`` group when the app has one and creates the group otherwise.  Without the main
command: ``python -m kvsieve.eval eval ...`` / ``report DIR`` / ``analyze trace ...``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)  # logs: do not squeeze the tables to 80 columns


def _pairs(pairs: list[str], flag: str) -> dict:
    """``key=value`` options; values read as JSON when they parse (numbers, true/false), else text."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise typer.BadParameter(f"{flag} expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def usage_error(err: ValueError, command=None, flags: dict[str, str] | None = None, settings_flag: str = "--set",
                param_hint: str | None = None) -> typer.BadParameter:
    """A typer usage error (one clean message, no traceback) for ``err``, in the command line's terms:
    a ``SettingError`` names its setting by the flag that set it: ``flags[setting]`` (``eval`` takes
    a budget by ``--budgets``; a setting given as ``--set interval=...`` is ``--set interval`` even
    where ``--interval`` exists), else the option of that name of typer command function ``command``
    (``max_new_tokens`` -> ``--max-new-tokens``), else ``settings_flag setting`` (``--set sinks``)."""
    from ..checks import SettingError

    if not isinstance(err, SettingError):
        return typer.BadParameter(str(err), param_hint=param_hint)
    flag = (flags or {}).get(err.setting) or option_flag(command, err.setting) or f"{settings_flag} {err.setting}"
    return typer.BadParameter(err.in_terms(flag))


def option_flag(command, name: str) -> str | None:
    """The flag of parameter ``name`` of typer command function ``command`` (its declared long
    name, else ``--`` + the name with dashes), or None when it has no such option."""
    import inspect

    param = inspect.signature(command).parameters.get(name) if command is not None else None
    if param is None or not isinstance(param.default, typer.models.OptionInfo):
        return None
    declared = [d for d in param.default.param_decls or () if d.startswith("--")]
    return declared[0].split("/")[0] if declared else "--" + name.replace("_", "-")


EVAL_FLAGS = {"budget": "--budgets"}  # settings that eval takes by another flag than their name
THREADS_HELP = "torch CPU threads (default: torch's choice); rows record the count they ran with."


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (typer has checked it is >= 1); None leaves torch's default."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _bad(fn, *args, **kwargs):
    """Call ``fn`` turning user-input errors into a typer usage error that prints the message
    (a setting named by its flag of ``eval``, the command that takes settings)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as err:  # DataError is one
        raise usage_error(err, eval_command, flags=EVAL_FLAGS) from None


def eval_command(
    model: str = typer.Option(..., help="Bundled name, local directory or hub id."),
    dataset: str = typer.Option(..., help="gsm8k, math500, aime24, aime25, gpqa, passkey, needle or text."),
    data: Optional[str] = typer.Option(None, help="Local JSONL/CSV file or data directory (or the text file of 'text')."),
    data_opt: List[str] = typer.Option([], "--data-opt", help="Data set option key=value, e.g. context_tokens=4000."),
    limit: Optional[int] = typer.Option(None, help="N samples only (the first N after --skip)."),
    skip: int = typer.Option(0, help="Pass over the first N samples (--skip 100 --limit 50: samples 100-149)."),
    reference_limit: Optional[int] = typer.Option(
        None, help="full (the reference) on the first N samples only: for cells whose report joins an earlier "
                   "directory's full (kvsieve report DIR --join NEW)."),
    methods: str = typer.Option(
        "full", help="Comma-separated methods; full always runs as the reference. <method>+<variant> (e.g. "
                     "lazy+protect with --set lazy+protect.protect_prompt=true) is a cell of its own under its own "
                     "settings; <method>+steer (e.g. skipkv+steer, full+steer) runs the method with --steering."),
    budgets: str = typer.Option("128", help="Comma-separated KV budgets (tokens per kv head)."),
    set_: List[str] = typer.Option([], "--set", help="Method setting key=value (all methods) or method.key=value "
                                   "(method.key also sets its variants method+*; method+variant.key only that label)."),
    steering: Optional[Path] = typer.Option(
        None, "--steering", metavar="FILE",
        help="SkipKV steering vector (kvsieve steering build --model MODEL --out FILE), built for --model, "
             "used by the +steer methods only. Rows of those methods record settings.steering (strengths, vector "
             "sha256); a results directory refuses another vector or strength for them."),
    steering_set: List[str] = typer.Option(
        [], "--steering-set", help="Steering setting key=value over the vector's preset: alpha0, gamma or positions."),
    max_new_tokens: int = typer.Option(512),
    batch_size: int = typer.Option(8, help="Samples decoded together."),
    seed: int = typer.Option(0),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    prefill_chunk: int = typer.Option(512),
    compile: bool = typer.Option(False, "--compile", help="Compile the decode step (same tokens as eager; each "
                                 "shape compiles once per process, reused by every batch of the grid)."),
    out: Optional[Path] = typer.Option(None, help="Results directory (default runs/MODEL-DATASET)."),
    shard: str = typer.Option("0/1", help="i/n: run every n-th sample starting at i (one process per shard)."),
    writer: Optional[str] = typer.Option(
        None, help="Write rows to results.WRITER.jsonl, so several processes can fill disjoint cells of one --out "
                   "(e.g. one per budget; run full first, alone: every process runs the cells it lacks)."),
    ray: bool = typer.Option(False, "--ray", help="Run (cell, batch) tasks on Ray (pip install ray)."),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join (default: $RAY_ADDRESS, else a new local one; 'local': always a new one)."),
    ray_gpus: Optional[float] = typer.Option(
        None, help="GPUs per Ray task (fractions share a GPU); default: 1 on a cluster with GPUs, else 0."),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    threads: Optional[int] = typer.Option(None, min=1, help=THREADS_HELP),
    progress: bool = typer.Option(True, help="Progress bars with ETA per cell."),
    pin_commit: bool = typer.Option(False, "--pin-commit", help="Record the source's git commit in run.json and "
                                    "refuse rows from any other commit or from uncommitted changes."),
):
    """Run (or resume) a (method x budget) grid; one JSON line per finished sample.

    Steering (SkipKV Sec. 4.2): list a method twice, e.g. --methods skipkv,skipkv+steer --steering vec.pt,
    to get its rows without and with the steering vector side by side in one results directory.
    """
    from ..checks import InputError, SettingError
    from ..steering import SteeringModelError
    from .config import EvalConfig, parse_list, parse_shard, split_settings, split_steer
    from .report import rich_table, summarize
    from .runner import check_run_manifest, load_samples, make_cell_policy, run_grid
    from .store import load_results

    method_list = _bad(parse_list, methods, "--methods")
    if ray_gpus is not None and ray_gpus < 0:
        raise typer.BadParameter(f"must be >= 0 (a fraction shares a GPU), not {ray_gpus}", param_hint="--ray-gpus")
    config = _bad(
        EvalConfig, model=model, dataset=dataset, out=str(out or Path("runs") / f"{Path(model).name}-{dataset}"),
        methods=method_list, budgets=_bad(parse_list, budgets, "--budgets", int), limit=limit, skip=skip,
        reference_limit=reference_limit, data_path=data,
        data_options=_pairs(data_opt, "--data-opt"), max_new_tokens=max_new_tokens, temperature=temperature,
        seed=seed, prefill_chunk=prefill_chunk, batch_size=batch_size, compile=compile,
        settings=_bad(split_settings, _pairs(set_, "--set"), method_list), shard=_bad(parse_shard, shard),
        device=device, dtype=dtype, steering=None if steering is None else str(steering),
        steering_settings=_pairs(steering_set, "--steering-set"), writer=writer,
        pin_commit=pin_commit)
    # Everything the user can get wrong fails here, before the model loads, but for what only the
    # run can see (a steering vector built for another model, a results file whose writer is still
    # running, an unknown model name, a prompt over the model's context, LagKV's budget fit:
    # SteeringModelError, InputError, SettingError); other errors after this point are bugs and keep
    # their traceback.
    for cell in config.cells():
        _bad(make_cell_policy, config, cell)
    samples = _bad(load_samples, config)
    if samples and samples[0].grader == "perplexity" and any(split_steer(m)[1] for m in config.methods):
        raise typer.BadParameter(f"steering applies to generation; data set {dataset!r} is scored by perplexity: "
                                 "drop the +steer methods")
    _bad(check_run_manifest, config)
    set_threads(threads)
    try:
        store = run_grid(config, progress=progress, use_ray=ray, ray_address=ray_address, ray_gpus=ray_gpus)
    except SteeringModelError as err:
        raise typer.BadParameter(str(err), param_hint="--steering") from None
    except (InputError, SettingError) as err:  # what only the run can see (above)
        raise usage_error(err, eval_command, flags=EVAL_FLAGS) from None
    console.print(rich_table(summarize(load_results(config.out)), title=f"{model} on {dataset}"))
    console.print(f"rows in {store.path}; write the report with: kvsieve report {config.out}")


def report_command(
    directory: Path = typer.Argument(..., help="Results directory written by `kvsieve eval`."),
    plots: bool = typer.Option(True, help="Also draw the PNG plots."),
    common: bool = typer.Option(False, help="Only the samples every (method, budget) cell has (partial grids)."),
    join: list[Path] = typer.Option([], help="Another results directory whose cells join the table (same model, "
                                    "data and decoding in its run.json; repeatable). The files go to DIRECTORY."),
):
    """Write report.md, summary.csv and PNG plots for a results directory; print the table."""
    from .report import rich_table, write_report

    report = _bad(write_report, directory, plots=plots, common=common, join=join)
    title = f"{report.manifest.get('model', '')} on {report.manifest.get('dataset', '')}".strip()
    console.print(rich_table(report.summaries, title=title if title != "on" else ""))
    console.print("wrote " + ", ".join(str(p) for p in report.files))


def regrade_command(
    directory: Path = typer.Argument(..., help="Results directory written by `kvsieve eval`."),
    write: bool = typer.Option(False, "--write", help="Rewrite the results files (a copy of each is kept "
                               "beside it as .bak-regrade-<time>); without it only the changes are listed."),
    grader: Optional[str] = typer.Option(None, help="Grader kind for rows that lack one (written before rows "
                                         "recorded it); default: the kind of run.json's data set."),
):
    """Grade every stored answer again with the current graders and list the rows whose grade changed."""
    from .regrade import regrade

    found = _bad(regrade, directory, write=write, grader=grader)
    for change in found.changes:
        console.print(f"{change.key}: extracted {change.before[0]!r} -> {change.after[0]!r}, "
                      f"correct {change.before[1]} -> {change.after[1]}")
    console.print(f"{found.graded} of {found.rows} rows graded, {len(found.changes)} changed"
                  + (f"; old files kept as {', '.join(str(p) for p in found.backups)}" if found.backups else "")
                  + ("" if write or not found.changes else "; pass --write to store the new grades"))


def trace_command(
    model: str = typer.Option("smollm2-135m", help="Bundled name, local directory or hub id."),
    dataset: str = typer.Option("gsm8k", help="Data set of the sample (see `kvsieve eval --help`)."),
    data: Optional[str] = typer.Option(None, help="Local data file or directory."),
    data_opt: List[str] = typer.Option([], "--data-opt", help="Data set option key=value, as for `kvsieve eval`."),
    seed: int = typer.Option(0, help="Data seed, as for `kvsieve eval` (GPQA's option order, generated sets)."),
    sample: int = typer.Option(0, help="Index of the sample in the data set."),
    method: str = typer.Option("tova", help="Eviction method to trace."),
    budget: Optional[int] = typer.Option(128, help="KV budget (tokens per kv head)."),
    set_: List[str] = typer.Option([], "--set", help="Method setting key=value (repeatable)."),
    max_new_tokens: int = typer.Option(512),
    layer: Optional[int] = typer.Option(None, help="Draw one layer (default: share over all layers)."),
    head: Optional[int] = typer.Option(None, help="Draw one kv head (default: share over heads)."),
    out: Optional[Path] = typer.Option(None, help="Output directory (default runs/trace-METHOD-BUDGET)."),
    from_trace: Optional[Path] = typer.Option(None, "--from", help="Redraw a saved trace.npz instead of generating."),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Record which positions each kv head keeps at every compression for one sample, and draw a heatmap."""
    from ..analysis.trace import Trace, draw_heatmap, record_trace

    if from_trace is not None:
        trace = Trace.load(from_trace)
        directory = out or from_trace.parent
    else:
        from ..data import load_dataset
        from ..generate import GenerateConfig
        from ..methods import make_policy
        from ..models import load_model

        samples = _bad(load_dataset, dataset, path=data, limit=sample + 1, seed=seed,
                       **_pairs(data_opt, "--data-opt"))  # the sample `kvsieve eval` runs with these
        if sample >= len(samples):
            raise typer.BadParameter(f"--sample {sample}: {dataset} has only {len(samples)} samples")
        try:
            policy = make_policy(method, budget=budget, **_pairs(set_, "--set"))
        except ValueError as err:
            raise usage_error(err, trace_command) from None
        directory = out or Path("runs") / f"trace-{method}-{budget}"
        lm, tokenizer = _bad(load_model, model, device=device, dtype=dtype)
        config = GenerateConfig(max_new_tokens=max_new_tokens)
        item = samples[sample]
        trace = record_trace(lm, tokenizer, item.messages, policy, config,
                             meta={"model": model, "dataset": dataset, "id": item.id, "budget": budget})
    directory.mkdir(parents=True, exist_ok=True)
    saved = trace.save(directory / "trace.npz") if from_trace is None else from_trace
    suffix = ("" if layer is None else f"-layer{layer}") + ("" if head is None else f"-head{head}")
    png = _bad(draw_heatmap, trace, directory / f"trace{suffix}.png", layer=layer, head=head)
    console.print(f"{len(trace.steps())} compression events, {trace.meta.get('generated_tokens', '?')} generated "
                  f"tokens; wrote {saved} and {png}")


def _analyze_group(app: typer.Typer) -> typer.Typer:
    for info in app.registered_groups:
        if info.name == "analyze" and info.typer_instance is not None:
            return info.typer_instance
    group = typer.Typer(help="Offline analyses of attention and eviction.", no_args_is_help=True)
    app.add_typer(group, name="analyze")
    return group


def register(app: typer.Typer) -> None:
    """Add ``eval``, ``report``, ``regrade`` and ``analyze trace`` to ``app``."""
    app.command("eval")(eval_command)
    app.command("report")(report_command)
    app.command("regrade")(regrade_command)
    _analyze_group(app).command("trace")(trace_command)
