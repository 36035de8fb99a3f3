"""Eviction traces: exact kept positions per compression, persistence and the heatmap."""

import numpy as np
import pytest
import torch

from kvsieve.analysis.trace import Trace, TraceRecorder, _Recording, draw_heatmap, record_trace
from kvsieve.cache import DEAD_POS
from kvsieve.generate import GenerateConfig, generate
from kvsieve.methods import make_policy

PROMPT = [{"role": "user", "content": "Tell me a short story about a fox and a heron who meet at a river."}]
CONFIG = GenerateConfig(max_new_tokens=12)


@pytest.fixture(scope="module")
def streaming_trace(smollm):
    model, tok = smollm
    return record_trace(model, tok, PROMPT, make_policy("streaming", budget=20), CONFIG, meta={"id": "x"})


def test_streaming_trace_is_exact(smollm, streaming_trace):
    """StreamingLLM keeps sinks 0-3 and the newest budget - 4 positions: the trace must say exactly that."""
    model, _ = smollm
    trace = streaming_trace
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    steps = trace.steps()
    assert len(steps) == trace.meta["compression_events"] > 0 and trace.lost == 0
    assert len(trace) == len(steps) * layers * heads and trace.meta["layers"] == layers
    assert sorted(set(trace.layer)) == list(range(layers)) and sorted(set(trace.head)) == list(range(heads))
    for seen, kept in zip(trace.seen, trace.kept):
        expected = np.r_[0:4, seen - 16:seen]
        assert np.array_equal(kept, expected), (seen, kept)


def test_tracing_does_not_change_generation(smollm, streaming_trace):
    model, tok = smollm
    plain = generate(model, tok, [PROMPT], make_policy("streaming", budget=20), CONFIG)
    assert streaming_trace.meta["text"] == plain.texts[0]
    assert streaming_trace.meta["settings"] == make_policy("streaming", budget=20).settings()


def test_ragged_heads_are_traced_per_head(smollm):
    model, tok = smollm
    policy = make_policy("tova", budget=16, allocator="adakv", heads="group")
    trace = record_trace(model, tok, PROMPT, policy, GenerateConfig(max_new_tokens=6))
    sizes = [len(k) for k in trace.kept]
    assert len(set(sizes)) > 1  # heads keep different counts
    steps = trace.steps()
    per_event = {s: 0 for s in steps}
    for seen, kept in zip(trace.seen, trace.kept):
        per_event[seen] += len(kept)
        assert kept.max() < seen and np.all(np.diff(kept) > 0)
    heads = model.config.num_key_value_heads
    assert all(total <= 16 * heads * model.config.num_hidden_layers for total in per_event.values())


def test_save_load_and_heatmap(streaming_trace, tmp_path):
    path = streaming_trace.save(tmp_path / "trace.npz")
    loaded = Trace.load(path)
    assert loaded.meta["id"] == "x" and loaded.steps() == streaming_trace.steps()
    assert all(np.array_equal(a, b) for a, b in zip(loaded.kept, streaming_trace.kept))
    steps, matrix = loaded.kept_fraction(layer=3)
    assert matrix.shape == (len(steps), steps[-1])
    assert np.isnan(matrix[0, steps[0]:]).all() and (matrix[0, :4] == 1).all() and matrix[0, 5] == 0
    png = draw_heatmap(loaded, tmp_path / "trace.png", layer=3)
    assert png.read_bytes()[:4] == b"\x89PNG"


class FakeLayer:
    def __init__(self, pos):
        self.meta = {"pos": torch.tensor(pos, dtype=torch.int64)}


def test_reads_exclude_tokens_appended_after_the_compression():
    recording = _Recording(Trace())
    layer = FakeLayer([[[0, 5, 9, 10, DEAD_POS]]])  # position 10 was appended after compressing at seen=10
    recording.compressed(layer, torch.tensor([10]))
    recording.flush()
    assert recording.trace.kept[0].tolist() == [0, 5, 9]
    shrunk = FakeLayer([[[1, 2]]])  # not attached: a row left before the read and none is known
    recording.compressed(shrunk, torch.tensor([5, 6]))
    recording.flush()
    assert len(recording.trace) == 1 and recording.trace.lost == 2 and recording.number(shrunk) == 1


def test_reads_after_rows_left_are_attributed_to_prompt_indices():
    """Prompts 0, 1, 2 compress at seen 7, 8, 9; prompt 0 leaves before the read, so cache row 0
    now holds prompt 1 and cache row 1 prompt 2.  Each read goes to its prompt with that prompt's
    seen_tokens; prompt 0's heads are counted lost.  A later compression uses the new mapping."""
    recording = _Recording(Trace())
    recording.follow(torch.tensor([0, 1, 2]))
    layer = FakeLayer([[[0, 6], [1, 6]], [[0, 7], [2, 7]], [[0, 8], [3, 8]]])
    recording.compressed(layer, torch.tensor([7, 8, 9]))
    layer.meta["pos"] = layer.meta["pos"][[1, 2]]  # cache.select_rows([1, 2])
    recording.follow(torch.tensor([1, 2]))
    trace = recording.trace
    assert (trace.row, trace.seen, trace.head, trace.lost) == ([1, 1, 2, 2], [8, 8, 9, 9], [0, 1, 0, 1], 2)
    assert [k.tolist() for k in trace.kept] == [[0, 7], [2, 7], [0, 8], [3, 8]]
    recording.compressed(layer, torch.tensor([10, 11]))
    recording.flush()
    assert trace.row[4:] == [1, 1, 2, 2] and trace.seen[4:] == [10, 10, 11, 11]


def test_a_wrapped_policy_records_one_generate_call(smollm):
    model, tok = smollm
    policy = TraceRecorder().wrap(make_policy("streaming", budget=20))
    generate(model, tok, [PROMPT], policy, GenerateConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="one generate call: call recorder.finish"):
        generate(model, tok, [PROMPT], policy, GenerateConfig(max_new_tokens=2))


def test_full_cannot_be_traced():
    with pytest.raises(ValueError, match="evicts nothing"):
        TraceRecorder().wrap(make_policy("full"))


# ---------------------------------------------------------------------------- rows leaving mid-generation
SHORT_FIRST = [[{"role": "user", "content": "What is 7 times 8?"}], PROMPT]
BUDGET, SINKS, CHECK_EVERY = 20, 4, 4


def streaming_kept(seen: int) -> np.ndarray:
    """What StreamingLLM at BUDGET holds after compressing at ``seen``: sinks, then the newest tokens."""
    return np.array(sorted(set(range(SINKS)) | set(range(max(0, seen - (BUDGET - SINKS)), seen))))


@pytest.fixture(scope="module")
def early_stop(smollm):
    """(config, eos id) under which prompt 0 ends with "eos" several compressions before prompt 1 ends:
    the eos id is a token prompt 0 generates at step 9 that prompt 1 never generates (found by a
    plain greedy run: tracing does not change what is generated)."""
    model, tok = smollm
    config = GenerateConfig(max_new_tokens=24, ignore_eos=True)
    plain = generate(model, tok, SHORT_FIRST, make_policy("streaming", budget=BUDGET), config)
    first, second = plain.token_ids
    stop = next(t for t in first[9:] if t not in first[:9] and t not in second)
    return GenerateConfig(max_new_tokens=24, check_every=CHECK_EVERY), stop


def traced_with_early_stop(smollm, early_stop, monkeypatch):
    """Trace SHORT_FIRST with prompt 0 ending early."""
    model, tok = smollm
    config, stop = early_stop
    monkeypatch.setattr(model.generation_config, "eos_token_id", stop)
    recorder = TraceRecorder()
    policy = recorder.wrap(make_policy("streaming", budget=BUDGET))
    result = generate(model, tok, SHORT_FIRST, policy, config)
    assert [s.finish_reason for s in result.stats] == ["eos", "length"]
    assert result.stats[0].generated_tokens < result.stats[1].generated_tokens
    return recorder.finish(), result


def check_rows(trace, result, model):
    """Every record sits under its own prompt's index, at one of that prompt's compressions, and holds
    exactly what StreamingLLM keeps there; returns each prompt's (records, records expected)."""
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    counts = []
    for row, stat in enumerate(result.stats):
        mine = [i for i in range(len(trace)) if trace.row[i] == row]
        assert len(trace.steps(row)) == stat.compression_events > 0
        # a row decodes up to check_every - 1 tokens past its stop before it leaves (and compresses them)
        assert max(trace.steps(row)) < stat.prompt_tokens + stat.generated_tokens + CHECK_EVERY
        for i in mine:
            assert np.array_equal(trace.kept[i], streaming_kept(trace.seen[i])), (row, trace.seen[i])
        counts.append((len(mine), stat.compression_events * layers * heads))
    assert set(trace.row) == {0, 1}
    return counts


def test_rows_leaving_the_batch_keep_their_prompt_index_and_lose_nothing(smollm, early_stop, monkeypatch):
    """generate() drops finished rows (cache.select_rows): cache row 0 is then prompt 1.  Records
    carry prompt indices, and generate's on_rows_leave hook lets the recorder read the
    leaving prompt's last records first, so nothing is lost."""
    trace, result = traced_with_early_stop(smollm, early_stop, monkeypatch)
    (got0, want0), (got1, want1) = check_rows(trace, result, smollm[0])
    assert (got0, got1, trace.lost) == (want0, want1, 0)


def test_analyze_trace_command_writes_the_trace_and_its_heatmap(smollm, tmp_path):
    from typer.testing import CliRunner

    from kvsieve.cli import app

    data = tmp_path / "gsm.jsonl"
    data.write_text('{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "#### 7"}\n')
    out = tmp_path / "trace"
    result = CliRunner().invoke(app, ["analyze", "trace", "--data", str(data), "--method", "streaming", "--budget", "16",
                                      "--max-new-tokens", "12", "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "compression events" in result.output and (out / "trace.npz").exists() and (out / "trace.png").exists()
    redrawn = CliRunner().invoke(app, ["analyze", "trace", "--from", str(out / "trace.npz"), "--layer", "0"])
    assert redrawn.exit_code == 0 and (out / "trace-layer0.png").exists(), redrawn.output
    bad = CliRunner().invoke(app, ["analyze", "trace", "--data", str(data), "--sample", "5", "--out", str(out)])
    assert bad.exit_code == 2 and "has only 1 samples" in bad.output
    # data set options reach the loader, as in `kvsieve eval`
    bad = CliRunner().invoke(app, ["analyze", "trace", "--dataset", "passkey", "--data-opt", "depth=3"],
                             env={"COLUMNS": "200"})
    assert bad.exit_code == 2 and "unknown option(s) ['depth']" in bad.output
