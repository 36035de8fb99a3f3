"""scripts/serve_bench.py's pure parts (issue 57's benchmark through the server): vLLM's /metrics
page read, the KV pool's bytes from a model config, the ratio table, resuming.  No vLLM, no server:
runs in the project's .venv in about a second.  The servers themselves: run the script (its
docstring), as in the smoke run of its commit message."""

import json

import pytest

from vllm_support import load_script

bench = load_script("serve_bench")

# A /metrics page of vLLM 0.32's OpenAI server (kvsieve serve, one engine) mid-run, cut to the
# families the benchmark reads and a few it must skip: comments, a histogram with le="+Inf", a
# label value with an escaped quote, a sample with a timestamp.
PAGE = r"""# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.11.7"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="bench"} 14.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="bench"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="bench",reason="capacity"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="bench"} 0.873015873015873
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="bench"} 3.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="bench"} 1.7959252712324734e+09
vllm:request_success_total{engine="0",finished_reason="length",model_name="bench"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="bench"} 3.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="False",engine="0",kv_cache_memory_bytes="94371840",num_gpu_blocks="64",num_gpu_blocks_override="None",sliding_window="None"} 1.0
vllm:lora_requests_info{max_lora="1",running_lora_adapters="say \"hi\", twice",waiting_lora_adapters=""} 1.0 1795925271000
"""

# SmolLM2-135M's config.json (the bundled checkpoint), the fields that size its KV
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576, "dtype": "float32"}


def test_a_vllm_metrics_page_gives_running_waiting_usage_preemptions_and_the_pool():
    assert bench.snapshot(bench.parse_prometheus(PAGE)) == {
        "running": 14.0, "waiting": 2.0, "usage": 0.873015873015873, "preemptions": 3.0, "num_gpu_blocks": 64}


def test_prometheus_labels_values_and_timestamps_are_read_as_written():
    samples = {(name, labels.get("le")): (labels, value) for name, labels, value in bench.parse_prometheus(PAGE)}
    assert samples[("vllm:time_to_first_token_seconds_bucket", "+Inf")][1] == 3.0
    labels, value = samples[("vllm:lora_requests_info", None)]
    assert labels["running_lora_adapters"] == 'say "hi", twice' and labels["waiting_lora_adapters"] == ""
    assert value == 1.0  # the timestamp after it is not the value
    assert not any(name.startswith("#") or name == "HELP" for name, _ in samples)


def test_a_page_without_a_gauge_the_benchmark_reads_is_refused_by_name():
    page = "\n".join(line for line in PAGE.splitlines() if "kv_cache_usage_perc" not in line)
    with pytest.raises(ValueError, match="missing from /metrics: vllm:kv_cache_usage_perc"):
        bench.snapshot(bench.parse_prometheus(page))


def test_peaks_preemptions_in_the_run_and_blocks_from_usage():
    def snap(running, waiting, usage, preemptions):
        return {"running": running, "waiting": waiting, "usage": usage, "preemptions": preemptions}

    before = snap(0, 0, 0.0, 5)  # 5 preemptions from an earlier run of the same server
    during = [snap(2, 14, 20 / 63, 5), snap(16, 0, 55 / 63, 7), snap(9, 0, 40 / 63, 8)]
    after = snap(0, 0, 0.0, 8)
    # 64 blocks: vLLM's usage is over the 63 that are not its null block, so 55 / 63 is 55 blocks
    assert bench.peaks(before, during, after, 64) == {
        "peak_running": 16, "peak_waiting": 14, "preemptions": 3, "peak_usage": 0.873, "peak_blocks": 55,
        "usage_after": 0.0, "metrics_reads": 5}


def test_the_last_compaction_share_kvsieve_logged_is_read_from_the_server_log():
    log = ("(EngineCore pid=9) INFO 11-29 04:12:40 [worker.py:174] kvsieve: 120 steps, 30 compactions, "
           "compacting 41.5% of step time (2.5 of 6.0 s)\n"
           "(APIServer pid=8) INFO:     127.0.0.1:5 - \"POST /v1/completions HTTP/1.1\" 200 OK\n"
           "(EngineCore pid=9) INFO 11-29 04:13:10 [worker.py:174] kvsieve: 1040 steps, 210 compactions, "
           "compacting 9.8% of step time (4.9 of 50.1 s)\n")
    assert bench.compaction_share(log) == {"steps": 1040, "compactions": 210, "share_pct": 9.8, "compact_s": 4.9,
                                           "step_s": 50.1}
    assert bench.compaction_share("(APIServer pid=8) INFO: Application startup complete.\n") is None


def test_pool_bytes_from_the_model_config():
    # 2 (k, v) x 30 layers x 3 kv heads x 64 dims x 4 bytes
    assert bench.token_bytes(SMOLLM2, "float32") == 46_080
    assert bench.token_bytes(SMOLLM2, bench.model_dtype(SMOLLM2, "auto")) == 46_080
    # no head_dim, no kv heads (multi-head attention): 768 / 12 = 64 dims, 12 kv heads, fp16:
    # 2 x 6 x 12 x 64 x 2
    gpt = {"num_hidden_layers": 6, "num_attention_heads": 12, "hidden_size": 768, "torch_dtype": "float16"}
    assert bench.token_bytes(gpt, bench.model_dtype(gpt, "auto")) == 18_432
    assert bench.model_dtype(gpt, "bfloat16") == "bfloat16"
    with pytest.raises(bench.BenchError, match="no known size"):
        bench.token_bytes(SMOLLM2, "int3")


def test_each_method_gets_what_it_needs_to_be_served_and_the_server_line_carries_it():
    assert bench.method_settings("streaming", 128, None, None, horizon=1400) == {"budget": 128}
    assert bench.method_settings("streaming", 128, 32, None, horizon=1400) == {"budget": 128, "interval": 32}
    assert bench.method_settings("lagkv", 128, None, None, horizon=1400) == {
        "budget": 128, "options": {"off_grid": True}}
    assert bench.method_settings("ams:knorm", 128, None, None, horizon=1400)["options"] == {"skip_layers": 0}
    assert bench.method_settings("knorm", 128, None, None, horizon=1400)["options"] == {"skip_layers": 0}
    with pytest.raises(bench.BenchError, match="off_grid"):  # without the benchmark's table, kvsieve refuses it
        bench.method_settings("lagkv", 128, None, None, extra={"options": {}}, horizon=1400)

    workload = {"dtype": "float32", "block_size": 32, "max_model_len": 1400, "max_num_seqs": 16}
    lagkv = bench.server_argv({"method": "lagkv", "kvsieve": {"budget": 128, "options": {"off_grid": True}},
                               **workload}, bench.Path("/env"), "/model", 8000, 94_371_840)
    assert lagkv[:6] == ["/env/bin/kvsieve", "serve", "/model", "--method", "lagkv", "--budget"]
    assert "--interval" not in lagkv and lagkv[7:9] == ["--set", 'options={"off_grid": true}']
    plain = bench.server_argv({"method": "plain", **workload}, bench.Path("/env"), "/model", 8000, 94_371_840)
    assert plain[:5] == ["/env/bin/python", "-m", bench.ENTRY, "--model", "/model"]
    for argv in (lagkv, plain):  # the flags both servers share, the pool among them
        line = " ".join(argv)
        assert "--kv-cache-memory-bytes 94371840" in line and "--max-num-seqs 16" in line and "--enforce-eager" in line


def test_every_request_must_get_exactly_the_new_tokens():
    good = {"tokens": 16, "finish_reason": "length"}
    assert bench.token_check([good, good], 16) is None
    assert bench.token_check([good, {"tokens": 9, "finish_reason": "stop"}, {"error": "HTTP 400: too long"}], 16) == \
        "2 of 3 requests not 16 tokens; request 1: 9 tokens (finish_reason stop)"


def _run(method, pool, tokens_per_s, ok=True, slot=None):
    config = {"method": method, "pool_tokens": pool, "requests": 16, "new_tokens": 1024}
    if slot:
        config["slot"] = slot
    else:
        config["kvsieve"] = {"budget": 128}
    return {"config": config, "ok": ok, "tokens_per_s": tokens_per_s, "peak_running": 16, "peak_waiting": 0,
            "preemptions": 0, "peak_blocks": 60, "pool_blocks": pool // 32}


RUNS = [_run("plain", 2048, 40.0, slot="first"), _run("tova", 2048, 120.0), _run("streaming", 2048, None, ok=False),
        _run("plain", 2048, 48.0, slot="last"),
        _run("plain", 24576, 150.0, slot="first"), _run("tova", 24576, 142.5),
        _run("plain", 24576, None, ok=False, slot="last")]


def test_each_method_is_divided_by_the_first_and_last_plain_run_of_its_own_pool():
    rows = {(r["run"], r["pool_tokens"]): r for r in bench.ratios(RUNS)}
    # 120 / 40 and 120 / 48; at the loose pool 142.5 / 150, and no last plain run to divide by
    assert (rows[("tova", 2048)]["x_plain_before"], rows[("tova", 2048)]["x_plain_after"]) == (3.0, 2.5)
    assert (rows[("tova", 24576)]["x_plain_before"], rows[("tova", 24576)]["x_plain_after"]) == (0.95, None)
    assert (rows[("streaming", 2048)]["x_plain_before"], rows[("streaming", 2048)]["tokens_per_s"]) == (None, None)
    assert "x_plain_before" not in rows[("plain (first)", 2048)]
    lines = bench.table(bench.ratios(RUNS)).splitlines()
    assert lines[3] == "| tova | 2,048 | 120.0 | 3.00x / 2.50x | 16 | 0 | 0 | 60 / 64 |"
    assert lines[4].startswith("| streaming | 2,048 | FAILED | - / - |")
    assert lines[7] == "| tova | 24,576 | 142.5 | 0.95x / - | 16 | 0 | 0 | 60 / 768 |"


def test_configurations_run_plain_first_each_method_then_plain_again_for_each_pool():
    configs = bench.configurations(["tova", "lagkv"], [2048, 24576], {"requests": 16},
                                   {"tova": {"budget": 128}, "lagkv": {"budget": 128, "options": {"off_grid": True}}})
    assert [(c["pool_tokens"], c["method"], c.get("slot")) for c in configs] == [
        (2048, "plain", "first"), (2048, "tova", None), (2048, "lagkv", None), (2048, "plain", "last"),
        (24576, "plain", "first"), (24576, "tova", None), (24576, "lagkv", None), (24576, "plain", "last")]


def test_plain_every_n_methods_brackets_each_group_and_its_ratios_use_that_bracket():
    methods = ["tova", "lagkv", "h2o"]
    configs = bench.configurations(methods, [2048], {"requests": 16}, {m: {"budget": 128} for m in methods},
                                   plain_every=2)
    assert [(c["method"], c.get("slot"), c.get("plain")) for c in configs] == [
        ("plain", "first", None), ("tova", None, ["first", "after-2"]), ("lagkv", None, ["first", "after-2"]),
        ("plain", "after-2", None), ("h2o", None, ["after-2", "last"]), ("plain", "last", None)]
    speeds = {"first": 40.0, "after-2": 50.0, "last": 80.0, "tova": 100.0, "lagkv": 120.0, "h2o": 160.0}
    runs = [{**_run(c["method"], 2048, speeds[c.get("slot") or c["method"]], slot=c.get("slot")), "config": c}
            for c in configs]
    rows = {r["run"]: r for r in bench.ratios(runs)}
    # tova and lagkv against 40 and 50; h2o against 50 and 80
    assert [(rows[m]["x_plain_before"], rows[m]["x_plain_after"]) for m in methods] == [
        (2.5, 2.0), (3.0, 2.4), (3.2, 2.0)]
    # without it: one group, the first and the last plain runs, and no bracket in the configurations
    assert [c.get("plain") for c in bench.configurations(methods, [2048], {}, {m: {} for m in methods})] == [None] * 5


def test_resume_runs_only_what_is_missing_or_failed_and_keeps_the_rest(tmp_path, monkeypatch):
    configs = [RUNS[0]["config"], RUNS[1]["config"], RUNS[2]["config"], RUNS[3]["config"]]
    out = tmp_path / "bench.json"
    # a benchmark killed during its fourth run: plain and tova done, streaming failed
    out.write_text(json.dumps({"sessions": [{"command": "earlier"}], "runs": RUNS[:3]}))
    ran = []

    def run_one(config, *_):
        ran.append(config)
        return {**_run(config["method"], config["pool_tokens"], 30.0, slot=config.get("slot")), "config": config}

    needs = {"prompts": [], "model_dir": "/m", "bytes_per_token": 1}
    monkeypatch.setattr(bench, "prepare", lambda args: (configs, needs))
    monkeypatch.setattr(bench, "run_one", run_one)
    monkeypatch.setattr(bench, "vllm_version", lambda env: "0.32.0")
    with pytest.raises(bench.BenchError, match="--resume continues it"):
        bench.main(["--out", str(out)])
    assert bench.main(["--out", str(out), "--resume", "--run-dir", str(tmp_path / "logs")]) == 0
    assert ran == [RUNS[2]["config"], RUNS[3]["config"]]
    saved = json.loads(out.read_text())
    assert [(r["config"]["method"], r["ok"], r["tokens_per_s"]) for r in saved["runs"]] == [
        ("plain", True, 40.0), ("tova", True, 120.0), ("streaming", True, 30.0), ("plain", True, 30.0)]
    assert [s.get("vllm") for s in saved["sessions"]] == [None, "0.32.0"] and saved["runs"][-1]["session"] == 1
