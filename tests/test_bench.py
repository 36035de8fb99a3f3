"""``kvsieve bench overhead``: the timed caches hold what the figures claim they hold."""

from __future__ import annotations

import math

import pytest

from kvsieve import make_policy
from kvsieve.attention import ATTN_IMPLEMENTATION
from kvsieve.bench.overhead import filled_session, lag_steady_state, lag_tokens_until_due, time_method


@pytest.fixture()
def model(smollm):
    model, _ = smollm
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    yield model
    model.set_attn_implementation(previous)


def test_filled_session_is_prefilled_through_the_session_and_decoding_adds_more(model):
    """The bench cache is a real prompt's: every position 0..95 live in every layer, real queries
    recorded for the scorer, the prompt counted as seen; untimed decode steps add tokens."""
    from kvsieve.bench.overhead import decode_untimed

    session = filled_session(model, make_policy("snapkv", budget=96, protect_prompt=False), batch=2, length=96, steps=4)
    cache = session.cache
    layer = cache.layers[0]
    assert layer.live().sum(-1).tolist() == [[96] * 3] * 2
    assert sorted(layer.meta["pos"][0, 0][layer.live()[0, 0]].tolist()) == list(range(96))
    assert cache.seen_tokens.tolist() == [96, 96] and layer.recent_queries is not None
    decode_untimed(session, 5)
    assert all(l.live().sum(-1).eq(101).all() for l in cache.layers)
    assert cache.seen_tokens.tolist() == [101, 101]


def test_a_method_that_protects_its_prompt_is_timed_compressing(model):
    """With its prompt protected (triattention, or rkv+protect) a method would never compress here; the bench's filled tokens stand for generated ones, so its
    timed compression must actually evict (before, the protected fill was never compressed)."""
    from kvsieve.bench.overhead import _Timed

    timed = _Timed(model, "rkv", batch=1, length=160, steps=2, budget=96)
    assert timed.policy.protect_prompt is False and timed.interval > 1
    timed.compression()
    assert int(timed.session.cache.layers[0].live().sum(-1).max()) == 96


@pytest.mark.parametrize("method", ["full", "tova", pytest.param("snapkv", marks=pytest.mark.slow)])  # snapkv: decodes its interval untimed
def test_time_method_gives_finite_paired_step_times_for_every_step_and_interval_methods(model, method):
    ours, full, compression = time_method(model, method, batch=1, length=96, steps=2)
    assert 0 < ours < 60 and 0 < full < 60
    if method == "full":
        assert ours == full and compression == 0  # full against itself is one measurement
    ours, full, compression = time_method(model, method, batch=1, length=160, steps=2, budget=96)
    assert 0 < ours < 60 and 0 < full < 60
    assert (compression > 0) == (method == "snapkv")  # tova evicts inside its step


@pytest.mark.slow  # prefills LagKV's steady state and decodes two partitions untimed: about a minute
def test_lagkv_timing_compresses_one_partition_per_charged_compression(model):
    from kvsieve.bench.overhead import _Timed

    timed = _Timed(model, "lagkv", batch=1, length=200, steps=2, budget=None)
    assert timed.interval == 128 and timed.filled == lag_steady_state(timed.policy.scorer, 200)
    assert int(timed.session.cache.layers[0].live().sum(-1).max()) == 200  # the prompt's own compression
    before = int(timed.session.cache.layers[0].live().sum(-1).max())
    seconds = timed.compression()  # twice: up to the due partition, then L more; each drops L - k
    live = int(timed.session.cache.layers[-1].live().sum(-1).max())
    seen = int(timed.session.cache.seen_tokens[0])
    assert 0 < seconds < 60 and live == before + (seen - timed.filled) - 2 * (128 - 32)
    ours, full, compression = time_method(model, "lagkv", batch=1, length=200, steps=2)
    assert 0 < ours < 60 and 0 < full < 60 and 0 < compression < 60


def test_paired_timing_runs_full_and_the_method_alternately_on_their_own_caches(model, monkeypatch):
    """Each timed step of the method sits next to a timed step of full (alternating order), and
    the method's cache holds the budget while full's holds the length."""
    import kvsieve.bench.overhead as overhead

    order, held = [], []
    real_step = overhead._Timed.step

    def spy(self):
        order.append(self.policy.name)
        held.append(int(self.session.cache.layers[0].live().sum(-1).max()))
        return real_step(self)

    monkeypatch.setattr(overhead._Timed, "step", spy)
    time_method(model, "tova", batch=1, length=160, steps=4, budget=96)
    timed = order[4:]  # after two warm-up rounds of both
    assert timed == ["full", "tova", "tova", "full", "full", "tova", "tova", "full"]
    # before each timed step: tova holds its budget; full, prefilled with 2 tokens fewer than the
    # length, holds the length at the first timed step (the two warm-up steps appended the rest)
    assert held[4:] == [160, 96, 96, 161, 162, 96, 96, 163]


def test_lagkv_has_no_budget_to_hold_a_length_at():
    assert all(math.isnan(t) for t in time_method(None, "lagkv", batch=1, length=64, steps=2, budget=32))


def test_lagkv_is_timed_in_steady_state_with_its_next_partition_due_within_l_steps():
    scorer = make_policy("lagkv").scorer  # S 16, L 128, k 32
    seen = lag_steady_state(scorer, 2048)
    frozen = (seen - 2048) // (128 - 32)
    assert seen - 16 - frozen * 128 == 2048 - 16 - frozen * 32  # live = sinks + frozen * k + tail
    tail = seen - 16 - frozen * 128
    assert 128 <= tail < 128 + 32 and lag_tokens_until_due(scorer, seen, 2048) == 256 - tail
    assert lag_tokens_until_due(scorer, seen + 256 - tail, 2048 + 256 - tail) == 0
    with pytest.raises(ValueError, match="leave no frozen partition"):
        lag_steady_state(scorer, 150)


def test_grouping_bench_changes_padding_not_the_rows_budgets(smollm, tmp_path):
    """Padding is dead after prefill in kvsieve, so sorting prompts by length (SkipKV Eq. 12)
    can only change padding and prefill work, never a row's live KV tokens."""
    import json

    from kvsieve.bench.grouping import measure
    from kvsieve.bench.settings import GroupingSettings

    model, tok = smollm
    questions = ["What is 2 + 2?", "A farmer has 17 sheep and buys 5 more, then sells 3 of them at the market. "
                 "How many sheep does the farmer have now?", "What is 9 times 3?",
                 "Sara reads 12 pages a day for 4 days and then 7 pages on the fifth day. How many pages in all?"]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))
    args = GroupingSettings(dataset="gsm8k", data=str(data), samples=4, batch=2, new_tokens=4, method="streaming",
                            budget=64)
    result = measure(model, tok, args)
    plain, grouped = result["rows"]
    assert grouped["padding_tokens"] < plain["padding_tokens"]
    assert result["identical_peaks"] == 4 and result["prompts"] == 4


# ---------------------------------------------------------------------------- memory / throughput / long
def test_scale_benchmarks_take_issue_7s_defaults_and_the_options_given():
    from kvsieve.bench.settings import BENCHMARKS, LongSettings, names, numbers

    long_args = LongSettings()
    assert (names(long_args.methods), long_args.budget, long_args.batch, numbers(long_args.lengths)) == (
        ["tova", "lazy"], 512, 8, [4096, 8192])
    assert names(LongSettings(methods="h2o", batch=2).methods) == ["h2o"]
    memory_args = BENCHMARKS["memory"](budget=64)  # the class kvsieve bench memory builds
    assert (memory_args.name, names(memory_args.methods), memory_args.budget) == ("memory", ["tova", "streaming"], 64)


def test_memory_benchmark_runs_the_batch_asked_for(smollm):
    from kvsieve.bench.scale import memory
    from kvsieve.bench.settings import MemorySettings

    model, tok = smollm
    result = memory(model, tok, MemorySettings(methods="streaming", budget=8, new_tokens=4, batch=2))
    assert [(r["method"], r["batch"]) for r in result["rows"]] == [("full", 2), ("streaming", 2)]


def test_throughput_reports_no_ratio_when_full_does_not_fit(smollm):
    """A limit that holds a bounded row but not a full one: the bounded row is measured, and no
    ratio is made against another method standing in for full."""
    from kvsieve.bench.scale import throughput
    from kvsieve.bench.settings import ThroughputSettings
    from kvsieve.memory import GB, planned_kv_bytes

    model, tok = smollm
    prompt_len = len(tok.apply_chat_template([{"role": "user", "content": "x" * 10}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)) + 40
    full_row = planned_kv_bytes(model, make_policy("full"), 1, prompt_len, 64)
    tova_row = planned_kv_bytes(model, make_policy("tova", budget=16), 1, prompt_len, 64)
    assert tova_row < full_row
    limit = (tova_row + full_row) / 2 / GB
    args = ThroughputSettings(methods="tova", budget=16, new_tokens=64, max_batch=1, kv_memory_gb=limit)
    rows = throughput(model, tok, args)["rows"]
    assert [r["method"] for r in rows] == ["tova"] and rows[0]["throughput_vs_full"] is None
    with pytest.raises(ValueError, match="raise --kv-memory-gb"):
        throughput(model, tok, ThroughputSettings(methods="tova", kv_memory_gb=1e-9))


def test_overhead_and_engine_results_get_a_plot(tmp_path):
    from kvsieve.bench import engine, overhead
    from kvsieve.bench.common import plot

    overhead_rows = [{"method": m, "length": 2048, "batch": b, "budget": None, "overhead_vs_full": o,
                      "speedup_vs_full": 1 / (1 + o)} for m, b, o in (("tova", 1, 0.05), ("tova", 8, 0.07), ("h2o", 8, 0.12))]
    engine_rows = [{"method": m, "batch": 1, "speed_vs_full": s, "kv_bytes_vs_full": k}
                   for m, s, k in (("full", 1.0, 1.0), ("tova", 1.1, 0.12))]
    for name, module, rows in (("o.json", overhead, overhead_rows), ("e.json", engine, engine_rows)):
        plot(tmp_path / name, lambda ax: module.draw(ax, rows))
        assert (tmp_path / name).with_suffix(".png").stat().st_size > 1000


def test_profile_flag_writes_a_chrome_trace_and_an_op_table(tmp_path):
    import json

    import torch

    from kvsieve.bench.common import profiled

    path = tmp_path / "prof" / "trace.json"
    with profiled(str(path)):
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert "traceEvents" in json.loads(path.read_text())
    assert "aten::mm" in (tmp_path / "prof" / "trace.json.txt").read_text()


@pytest.mark.slow  # ~7 s
def test_long_benchmark_reads_every_length_off_one_run_per_method(smollm):
    """One generation per method to the longest length; each shorter length is read off its clock,
    and the bounded method's KV bytes stay flat below full's."""
    from kvsieve.bench.scale import long
    from kvsieve.bench.settings import LongSettings

    model, tok = smollm
    result = long(model, tok, LongSettings(methods="streaming", budget=8, lengths="32,16", batch=2))
    assert [r["method"] for r in result["runs"]] == ["full", "streaming"]
    assert all(run["clock"][-1][0] == 32 and run["generated_tokens"] == 64 for run in result["runs"])
    rows = {(r["method"], r["new_tokens"]): r for r in result["rows"]}
    assert set(rows) == {(m, n) for m in ("full", "streaming") for n in (16, 32)}
    assert rows["full", 16]["speed_vs_full"] == 1.0 and rows["streaming", 32]["decode_tokens_per_s"] > 0
    assert rows["streaming", 32]["kv_bytes_at_length"] == rows["streaming", 16]["kv_bytes_at_length"]
    assert rows["streaming", 32]["kv_bytes_vs_full"] < 1
    with pytest.raises(ValueError, match="multiple of 8"):
        long(model, tok, LongSettings(lengths="30"))


def test_overhead_leaves_triattention_out_without_its_statistics_file(capsys):
    """TriAttention reads a per-model statistics file: without --stats it is named as not timed,
    never a traceback (it cannot be built without one)."""
    from kvsieve.bench.overhead import measure
    from kvsieve.bench.settings import OverheadSettings

    rows = measure(None, OverheadSettings(methods="triattention", lengths="64", batches="1", steps=2))
    assert rows == [] and "triattention   not timed: needs --stats FILE (kvsieve calibrate triattention)" in \
        capsys.readouterr().out


def test_the_long_clock_stops_while_a_step_compiles():
    """A compile that ends between two readings is taken off every later reading (an evicting
    step compiles when the cache first reaches the budget, which once read as a slow stretch);
    one that ends before the first reading shifts nothing. Expected values worked by hand."""
    from kvsieve.bench.common import tokens_per_s_between, without_compiling

    clock = [(8, 100.0), (256, 102.0), (512, 164.0), (768, 166.0)]
    spans = [(99.0, 30.0), (163.0, 60.0)]  # before the first reading; between 256 and 512
    assert without_compiling(clock, spans) == [(8, 0.0), (256, 2.0), (512, 4.0), (768, 6.0)]
    row = {"batch": 1, "clock": without_compiling(clock, spans)}
    assert tokens_per_s_between(row, 256, 512) == pytest.approx(256 / 2.0)
