"""The command lines of ``kvsieve analyze mri``, ``analyze retention``, ``analyze qk`` and ``calibrate triattention``.

They live apart from ``kvsieve.analysis.mri`` and ``.retention`` (which re-export them as their
``register``) so that registering them imports neither torch nor numpy: ``kvsieve --help`` and
``--version`` start in well under 2 s; each command imports its module when it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

DEFAULT_DATASET = Path("../shared/data/gsm8k_train.jsonl")  # relative to the repository root, as every data default
PROMPT_FIELDS = ("question", "problem", "prompt")  # GSM8K, MATH-500 / AIME24, AIME25
# TriAttention's calibration size (``kvsieve calibrate triattention``, ``kvsieve.analysis.qk.calibrate``):
# 4,096 tokens in chunks of 1,024, a CPU's budget.
# deviation: the official calibration (scripts/calibrate.py, --max-length 32768) feeds one pass of up to
# OFFICIAL_CALIBRATION_TOKENS; what the smaller size changes in the key ranking is measured with
# scripts/triattention_calibration_size.py in docs/triattention-calibration.md.
CALIBRATION_TOKENS = 4096
CALIBRATION_CHUNK = 1024
OFFICIAL_CALIBRATION_TOKENS = 32768


def register_mri(app) -> None:
    """Add the ``analyze`` group with its ``mri`` command to a typer app."""
    import typer
    from rich.console import Console
    from rich.table import Table

    group = typer.Typer(help="Offline analyses that choose method settings.", no_args_is_help=True)

    @group.command("mri")
    def mri(
        model: str = typer.Option("smollm2-135m", help="Bundled name, local directory or hub id."),
        dataset: Optional[Path] = typer.Option(None, help=f"JSONL with {'/'.join(PROMPT_FIELDS)} (default {DEFAULT_DATASET})."),
        samples: int = typer.Option(20, help="Problems (Table 11: 20 GSM8K, 5 MATH-500, 2 AIME)."),
        max_new_tokens: int = typer.Option(1024, help="New-token cap per problem."),
        alpha: Optional[float] = typer.Option(None, help="Threshold (default: Table 10 value of the model family)."),
        out: Path = typer.Option(Path("kvsieve-mri.json"), help="JSON that lazy window=auto reads; PNG beside it."),
        seed: int = typer.Option(0, help="Seed of the random choice of problems."),
        batch_size: int = typer.Option(1, help="Prompts generated together (faster; rows leave at their EOS)."),
        device: str = typer.Option("auto"),
        dtype: str = typer.Option("auto"),
    ):
        """Measure MRIs with a full cache and recommend LazyEviction's window W (80th percentile)."""
        from .. import models
        from ..checks import SettingError
        from ..files import check_output_file, reads
        from ..methods.lazy import read_window
        from .mri import analyze, load_prompts

        dataset = dataset or DEFAULT_DATASET
        try:
            prompts = load_prompts(dataset, samples, seed)
        except (OSError, ValueError) as err:
            raise typer.BadParameter(str(err)) from None
        check_output_file(out, ours=lambda p: reads(read_window, p), what="MRI file of kvsieve analyze mri")
        lm, tokenizer = models.load_model(model, device=device, dtype=dtype)
        try:
            s = analyze(lm, tokenizer, prompts, out, max_new_tokens, alpha,
                        info={"model": model, "dataset": str(dataset), "batch_size": batch_size}, batch_size=batch_size)
        except SettingError as err:  # a model type without a Table 10 alpha
            raise typer.BadParameter(err.in_terms("--alpha")) from None
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        table = Table(title=f"MRI of {s['tokens']:,} (layer, kv head, token) entries, {s['samples']} samples, alpha {s['alpha']:g}")
        table.add_column("MRI")
        table.add_column("% of re-activated tokens", justify="right")
        for bucket, frac in s["buckets"].items():
            table.add_row(bucket, f"{100 * frac:.1f}")
        console = Console()
        console.print(table)
        console.print("quantiles: " + ", ".join(f"{k} {v}" for k, v in s["quantiles"].items()))
        console.print(f"never re-activated: {100 * s['fraction_never_reactivated']:.1f}%, "
                      f"MRI > 1: {100 * s['fraction_recurring']:.1f}%, mean generated {s['mean_generated_tokens']:.0f}")
        console.print(f"[bold]recommended W = {s['recommended_window']}[/] (80th percentile); wrote {out}"
                      + (f" and {s['png']}" if s["png"] else " (install matplotlib for the histogram)"))

    app.add_typer(group, name="analyze")


def analyze_group(app, caller: str):
    """The app's ``analyze`` typer group, which ``register_mri`` creates (``caller`` names who needs it)."""
    group = next((info.typer_instance for info in app.registered_groups if info.name == "analyze"), None)
    if group is None:
        raise ValueError(f"{caller}: the app has no 'analyze' group; register kvsieve.analysis.mri first")
    return group


def register_retention(app) -> None:
    """Add ``retention`` to the app's existing ``analyze`` typer group."""
    import typer
    from rich.console import Console
    from rich.table import Table

    group = analyze_group(app, "retention.register")

    @group.command("retention")
    def retention(
        paths: list[Path] = typer.Argument(..., help="Trace .npz files and/or eval results (.jsonl or directory)."),
        region: int = typer.Option(32, help="Region size in tokens for the wipe-out rate."),
        max_gap: int = typer.Option(4, help="Largest gap inside one proxy segment."),
        ngram: int = typer.Option(4, help="n of the n-gram repetition rate."),
        generated_only: bool = typer.Option(False, help="Middle retention over the generated tokens only."),
    ):
        """Region wipe-out, retained-set IoU, proxy segments, middle retention and repetition per run."""
        import numpy as np

        from .retention import _read_rows, ngram_repetition, results_repetition, trace_diagnostics
        from .trace import Trace

        table = Table(title="retention diagnostics (definitions: kvsieve.analysis.retention)")
        trace_only = ("events", "wipe-out %", "IoU", "span IoU", "#segs", "seg len", "middle kept", "prompt kept",
                      "prompt kept (last)")  # a results.jsonl has no eviction events: "-" in these
        for col in ("run", "method", *trace_only, f"{ngram}-gram rep. %", "gen. tokens"):
            table.add_column(col)
        fmt = lambda x, scale=1.0: "-" if x is None or np.isnan(x) else f"{scale * x:.3g}"  # noqa: E731
        for path in paths:
            if path.suffix == ".npz":
                try:
                    trace = Trace.load(path)
                except ValueError as err:
                    raise typer.BadParameter(str(err)) from None
                prompt = int(trace.meta.get("prompt_tokens", 0))
                s = trace_diagnostics(trace, region, max_gap, prompt if generated_only else 0, prompt)["summary"]
                rep = ngram_repetition(str(trace.meta.get("text", "")).split(), ngram)
                run = f"{path.parent.name}/{path.name}" if path.name == "trace.npz" else path.name  # analyze trace's out dir
                table.add_row(run, str(trace.meta.get("method", "?")), str(s["events"]),
                              fmt(s["wipeout_rate"], 100), fmt(s["iou"]), fmt(s["span_iou"]), fmt(s["segments"]),
                              fmt(s["segment_length"]), fmt(s["middle_retention"]), fmt(s["prompt_retention"]),
                              fmt(s["prompt_retention_last"]), fmt(rep, 100),
                              str(trace.meta.get("generated_tokens", "-")))
                continue
            try:
                rows = _read_rows(path)
            except (OSError, ValueError) as err:
                raise typer.BadParameter(f"{path}: {err}") from None
            for (method, budget), s in sorted(results_repetition(rows, ngram).items(), key=str):
                table.add_row(path.name, f"{method} @ {budget}", *["-"] * len(trace_only),
                              fmt(s["repetition"], 100), f"{s['generated_tokens']:.0f}")
        Console().print(table)


def _model_and_texts(model: str, data: Path, device: str, dtype: str):
    """``(model, tokenizer, texts)`` for the Q/K commands; a bad model or data file is a usage error."""
    import typer

    from .. import models
    from .qk import read_texts

    try:
        texts = read_texts(data)
        lm, tokenizer = models.load_model(model, device=device, dtype=dtype)
    except (ValueError, models.ModelNotInstalledError) as err:
        raise typer.BadParameter(str(err)) from None
    return lm, tokenizer, texts


def register_calibrate(app) -> None:
    """Add the ``calibrate`` group with its ``triattention`` command to a typer app."""
    import typer

    group = typer.Typer(help="Per-model statistics that a method reads.", no_args_is_help=True)

    @group.command("triattention")
    def triattention(
        model: str = typer.Option("smollm2-135m", help="Bundled name, local directory or hub id."),
        data: Path = typer.Option(DEFAULT_DATASET, help="Plain text file, or JSONL (question/answer/text fields)."),
        out: Path = typer.Option(Path("triattention-stats.pt"), help="Statistics file (stats=FILE of triattention)."),
        force: bool = typer.Option(False, "--force", help="Overwrite --out even when it is no statistics file."),
        tokens: int = typer.Option(CALIBRATION_TOKENS, help="Tokens of the data to run through the model (the official "
                                   f"code: one pass of up to {OFFICIAL_CALIBRATION_TOKENS:,}; "
                                   "docs/triattention-calibration.md)."),
        chunk: int = typer.Option(CALIBRATION_CHUNK, help="Tokens per forward pass (each chunk starts at position 0)."),
        device: str = typer.Option("auto"),
        dtype: str = typer.Option("auto"),
    ):
        """Pre-RoPE query centres and norms of every head (TriAttention's statistics), with the
        model's RoPE frequencies and fingerprint."""
        import time

        from rich.console import Console

        from ..files import check_output_file, reads, write_atomic
        from ..methods.triattention import QueryStats
        from .qk import calibrate

        # before the model runs: a missing directory, or a file of another kind (through a link too)
        target = check_output_file(out, force=force, ours=lambda p: reads(QueryStats.read, p),
                                   what="TriAttention statistics file")
        lm, tokenizer, texts = _model_and_texts(model, data, device, dtype)
        start = time.perf_counter()
        try:
            stats = calibrate(lm, tokenizer, texts, tokens=tokens, chunk=chunk, data=str(data))
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        write_atomic(target, stats.save, "writing the statistics")
        L, H, F, _ = stats.q_mean.shape
        Console().print(f"calibrated {model} on {stats.settings['tokens']:,} tokens of {data} in "
                        f"{time.perf_counter() - start:.1f} s: {L} layers x {H} query heads x {F} frequency pairs; "
                        f"wrote {out} ({out.stat().st_size:,} bytes)")

    app.add_typer(group, name="calibrate")


def register_qk(app) -> None:
    """Add ``qk`` to the app's existing ``analyze`` typer group."""
    import typer

    group = analyze_group(app, "register_qk")

    @group.command("qk")
    def qk(
        model: str = typer.Option("smollm2-135m", help="Bundled name, local directory or hub id."),
        data: Path = typer.Option(DEFAULT_DATASET, help="Plain text file, or JSONL (question/answer/text fields)."),
        out: Path = typer.Option(Path("kvsieve-qk"), help="Directory for qk.json and qk.png."),
        tokens: int = typer.Option(2048, help="Tokens of the data to run through the model."),
        chunk: int = typer.Option(512, help="Tokens per forward pass (each chunk starts at position 0)."),
        max_distance: int = typer.Option(128, help="Largest query-key distance measured."),
        device: str = typer.Option("auto"),
        dtype: str = typer.Option("auto"),
    ):
        """Q/K concentration of every head and the distance preference its centres predict, against
        the attention measured by distance (TriAttention's analysis)."""
        from rich.console import Console

        from ..files import check_output_dir
        from .qk import analyze

        check_output_dir(out)
        lm, tokenizer, texts = _model_and_texts(model, data, device, dtype)
        try:
            s = analyze(lm, tokenizer, texts, out, tokens=tokens, chunk=chunk, max_distance=max_distance,
                        info={"model": model, "data": str(data)})
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        Console().print(f"{s['tokens']:,} tokens: mean Q concentration {s['q_concentration_mean']:.3f}, K "
                        f"{s['k_concentration_mean']:.3f}; correlation of the predicted and the measured logit by "
                        f"distance: median {s['correlation_median']:.3f} over {len(s['heads'])} heads; wrote "
                        f"{out / 'qk.json'} and {s['png']}")
