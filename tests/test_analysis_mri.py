"""``kvsieve analyze mri``: MRI distribution, the recommended W (80% threshold, LazyEviction
App. C), the saved analysis that ``lazy`` reads with ``window="auto"``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from kvsieve.analysis.mri import load_prompts, register, summarize
from kvsieve.methods import make_policy

QUESTIONS = ["What is 3 plus 4?", "Tom has 5 apples and eats 2. How many are left?", "What is 10 divided by 2?"]


def test_recommended_window_is_the_smallest_w_covering_80_percent_of_recurring_tokens():
    mri = np.array([0, 0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55])
    s = summarize(mri)
    recurring = mri[mri >= 1]
    W = s["recommended_window"]
    assert W == 21
    assert (recurring <= W).mean() >= 0.8 > (recurring <= W - 1).mean()
    assert s["tokens"] == 12 and s["fraction_never_reactivated"] == pytest.approx(2 / 12)
    assert s["fraction_recurring"] == pytest.approx(8 / 12)  # MRI > 1 (Finding 2)
    assert sum(s["buckets"].values()) == pytest.approx(1.0)
    assert s["counts_by_mri"][1] == 2 and sum(s["counts_by_mri"]) == 10
    with pytest.raises(ValueError, match="no token was re-activated"):
        summarize(np.zeros(5, dtype=int))


def test_the_recorder_tracks_as_lazy_does_over_decoding_steps_only():
    """The analysis that chooses W sees the intervals ``lazy`` will track (issue 35): the prompt's
    queries are no steps and the prompt is born at the prefill, then decoding steps update TS/MRI."""
    import torch

    from kvsieve.analysis.mri import MRIRecorder
    from kvsieve.cache import SieveCache
    from kvsieve.methods.lazy import LazyEviction

    g = torch.Generator().manual_seed(0)
    n, prompt = 9, 5
    attention = torch.rand(n, n, generator=g).tril()  # every query attends every earlier token >= alpha often
    states = []
    for scorer in (MRIRecorder(alpha=0.2), LazyEviction(alpha=0.2)):
        cache = SieveCache(1, meta_init=scorer.needs.meta)
        cache.begin_step(torch.arange(prompt)[None])
        cache.update(torch.randn(1, 1, prompt, 4), torch.randn(1, 1, prompt, 4), 0)
        layer = cache.layers[0]
        probs = torch.zeros(1, 1, 1, prompt, layer.capacity)
        probs[0, 0, 0, :, :prompt] = attention[:prompt, :prompt]
        scorer.observe(layer, probs, torch.arange(prompt)[None])
        assert layer.meta["ts"][0, 0, :prompt].tolist() == [prompt - 1] * prompt  # born at the prefill
        assert layer.meta["mri"][0, 0, :prompt].tolist() == [0] * prompt  # prompt queries are no steps
        for q in range(prompt, n):
            cache.begin_step(torch.tensor([[q]]))
            cache.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), 0)
            probs = torch.zeros(1, 1, 1, 1, layer.capacity)
            probs[0, 0, 0, 0, : q + 1] = attention[q, : q + 1]
            scorer.observe(layer, probs, torch.tensor([[q]]))
        states.append((layer.meta["ts"][0, 0, :n].tolist(), layer.meta["mri"][0, 0, :n].tolist()))
    assert states[0] == states[1] and max(states[0][1]) > 0


def test_load_prompts_samples_seeded_rows_of_gsm8k_or_math_files(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in QUESTIONS))
    two = load_prompts(gsm, 2, seed=3)
    assert len(two) == 2 and set(two) <= set(QUESTIONS) and two == load_prompts(gsm, 2, seed=3)
    assert load_prompts(gsm, 10) == QUESTIONS  # all rows, file order
    math = tmp_path / "math.jsonl"
    math.write_text(json.dumps({"problem": "Solve x + 1 = 2."}) + "\n")
    assert load_prompts(math, 1) == ["Solve x + 1 = 2."]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no usable field"}) + "\n")
    with pytest.raises(ValueError, match="question/problem/prompt|fields"):
        load_prompts(bad, 1)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        load_prompts(gsm, 0)


def test_cli_writes_json_and_png_that_lazy_window_auto_reads(smollm, tmp_path, monkeypatch):
    import kvsieve.models

    model, tok = smollm
    monkeypatch.setattr(kvsieve.models, "load_model", lambda *a, **k: smollm)
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q}) + "\n" for q in QUESTIONS))
    out = tmp_path / "analysis" / "mri.json"
    app = typer.Typer()

    @app.callback()
    def main():
        """test app"""

    register(app)
    n_new = 8
    result = CliRunner().invoke(app, ["analyze", "mri", "--dataset", str(data), "--samples", "2",
                                      "--max-new-tokens", str(n_new), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "recommended W" in result.output
    saved = json.loads(out.read_text())
    assert saved["samples"] == 2 and saved["alpha"] == 5e-4  # SmolLM2 is llama: Table 10's llama value
    W = saved["recommended_window"]
    counts = np.array(saved["counts_by_mri"])
    share = np.cumsum(counts) / counts.sum()
    assert share[W] >= 0.8 > share[W - 1]
    # full cache: every prompt token and every fed generated token of both samples, in 30 layers x 3 kv heads
    prompts = load_prompts(data, 2)
    lengths = [len(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)) for p in prompts]
    assert saved["mean_generated_tokens"] == n_new
    assert saved["tokens"] == sum(n + n_new - 1 for n in lengths) * 30 * 3
    png = out.with_suffix(".png")
    assert saved["png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    policy = make_policy("lazy", budget=2 * W + 32, window="auto", analysis=str(out))  # B >= 2W
    assert (policy.interval, policy.recent) == (W, W)


@pytest.mark.slow  # ~10 s: kept out of the default suite's 10 minutes
def test_batched_collection_reads_every_row_once_including_rows_that_finish_early(smollm):
    """Rows leave a batch at their EOS; their MRIs are read as they leave, so a batch of three
    yields exactly the (layer, kv head, token) entries of three one-prompt runs."""
    from kvsieve.analysis.mri import collect_mri

    model, tok = smollm
    prompts = [*QUESTIONS, "Say OK and stop."]
    one, gen_one = collect_mri(model, tok, prompts, 24, alpha=5e-4)
    batched, gen_batched = collect_mri(model, tok, prompts, 24, alpha=5e-4, batch_size=3)
    assert gen_batched == gen_one
    assert batched.size == one.size
    # same greedy tokens; MRIs may differ where batched float sums cross alpha, which is rare
    assert np.abs(np.sort(batched) - np.sort(one)).mean() < 0.05
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        collect_mri(model, tok, prompts, 4, alpha=5e-4, batch_size=0)


def test_a_model_type_without_a_table_10_alpha_is_refused_naming_alpha(tmp_path):
    """``analyze`` takes alpha from the model's family (App. C, Table 10) as ``lazy`` does; for a
    type the table has no value for it names its own fix, ``alpha`` (it has no ``family``)."""
    from types import SimpleNamespace

    from kvsieve.analysis.mri import analyze
    from kvsieve.checks import SettingError

    model = SimpleNamespace(config=SimpleNamespace(model_type="gpt2"))
    with pytest.raises(SettingError) as refused:
        analyze(model, None, QUESTIONS, tmp_path / "mri.json")
    assert refused.value.setting == "alpha"
    message = refused.value.in_terms("--alpha")
    assert "no alpha for model type 'gpt2'; set --alpha" in message and "family" not in message
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        analyze(model, None, QUESTIONS, tmp_path / "mri.json", alpha=2.0)
