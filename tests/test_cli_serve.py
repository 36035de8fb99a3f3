"""``kvsieve serve`` before vLLM starts (issue 49, step 5): every bad setting is one line naming
the fix, and where vLLM is missing the command says how to get it.  No vLLM is needed here; the
server itself is tested in tests/test_vllm_server.py, in the vLLM environment."""

import importlib.util
import json
import subprocess
import sys

import pytest

from cli_support import runner, usage_error
from kvsieve.cli import app
from kvsieve.vllm import REQUEST_CHECK
from kvsieve.vllm.serve import take_logits_processors, vllm_argv


def error_of(*args) -> str:
    """The usage error of ``kvsieve serve ARGS`` as one line."""
    return usage_error("serve", *args)


@pytest.mark.parametrize("args, expected", [
    (["--method", "tova-not-a-method", "--budget", "64"], "unknown method 'tova-not-a-method'; choose one of"),
    (["--method", "streaming"], "method 'streaming' needs a positive budget"),
    (["--method", "streaming", "--budget", "64", "--sinks", "-1"], "sinks= must be >= 0, got -1"),
    (["--method", "streaming", "--budget", "64", "--interval", "0"], "interval= must be >= 1, got 0"),
    (["--method", "streaming", "--budget", "64", "--set", "window=8"], "unknown vLLM setting(s) ['window']"),
    (["--method", "streaming", "--budget", "64", "--set", "sinks=four"], "sinks= must be an integer, got 'four'"),
    (["--method", "skipkv", "--budget", "64"], "skipkv with these settings is not served inside vLLM: it needs a per-token"),
    (["--method", "streaming", "--budget", "64", "--set", "sinks"], "--set expects key=value, got 'sinks'"),
    (["--method", "streaming", "--budget", "64", "--enable-prefix-caching"],
     "kvsieve serve sets --enable-prefix-caching itself; drop it"),
    (["--method", "streaming", "--budget", "64", "--additional-config={}"],
     "kvsieve serve sets --additional-config itself; drop it"),
    (["--method", "streaming", "--budget", "64", "--model", "other"],
     "kvsieve serve sets --model itself; drop it (the model is the first argument"),
])
def test_bad_settings_are_one_line_usage_errors(args, expected):
    assert expected in error_of("smollm2-135m", *args)


def test_a_method_not_served_says_why():
    assert "caote:tova with these settings is not served inside vLLM: it evicts the prompt block by block" in error_of(
        "smollm2-135m", "--method", "caote:tova", "--budget", "64")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_it_says_how_to_get_the_vllm_environment():
    result = runner.invoke(app, ["serve", "smollm2-135m", "--method", "streaming", "--budget", "64",
                                 "--port", "8011"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "vLLM is not installed" in lines[0] and "make vllm-env" in lines[0]


def test_the_vllm_command_line_carries_the_engine_arguments_then_the_passed_options():
    engine = {"scheduler_cls": "a.Sched", "worker_cls": "a.Worker", "enable_prefix_caching": False,
              "additional_config": {"kvsieve": {"method": "streaming", "budget": 64}}}
    argv = vllm_argv("/models/m", engine, ["--port", "8011", "--block-size", "32"])
    assert argv == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "/models/m",
                    "--scheduler-cls", "a.Sched", "--worker-cls", "a.Worker", "--no-enable-prefix-caching",
                    "--additional-config", '{"kvsieve": {"method": "streaming", "budget": 64}}',
                    "--port", "8011", "--block-size", "32"]
    assert json.loads(argv[argv.index("--additional-config") + 1]) == engine["additional_config"]


def test_logits_processors_go_after_kvsieves_request_check():
    """kvsieve's request check is a logits processor (``engine_kwargs``); processors passed on the
    command line are taken out and added after it, since a second ``--logits-processors`` flag would
    replace it."""
    args = ["--port", "8011", "--logits-processors", "a:P", "b:Q", "--block-size", "32", "--logits-processors=c:R"]
    rest, named = take_logits_processors(args)
    assert rest == ["--port", "8011", "--block-size", "32"] and named == ["a:P", "b:Q", "c:R"]
    engine = {"scheduler_cls": "a.Sched", "logits_processors": [REQUEST_CHECK, *named]}
    argv = vllm_argv("/models/m", engine, rest)
    assert argv[argv.index("--logits-processors"):] == ["--logits-processors", REQUEST_CHECK, "a:P", "b:Q", "c:R",
                                                       "--port", "8011", "--block-size", "32"]


def test_importing_the_cli_and_the_serve_module_imports_no_vllm():
    code = "import sys, kvsieve.cli, kvsieve.vllm.serve\nprint('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
