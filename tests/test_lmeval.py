"""The lm-evaluation-harness model ``kvsieve`` on tiny local tasks (no hub access)."""

import json
from importlib import metadata
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kvsieve.eval.lmeval import KVSieveLM  # noqa: E402

ARITH = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8"), ("What is 7 - 2?", "5")]
MC = [("The sky on a clear day is", [" blue", " green"], 0), ("Two plus two equals", [" three", " four"], 1)]
FEWSHOT = "Question: What is 1 + 1?\nAnswer: 2\n\nQuestion: What is 3 + 3?\nAnswer: 6\n\n"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Two tasks over local JSONL files: generate_until arithmetic and a multiple-choice pair."""
    root = tmp_path_factory.mktemp("lmeval_tasks")
    arith, mc = root / "arith.jsonl", root / "mc.jsonl"
    arith.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in ARITH))
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in MC))
    (root / "kvsieve_arith.yaml").write_text(f"""\
task: kvsieve_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {arith}
test_split: test
output_type: generate_until
description: {json.dumps(FEWSHOT)}
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "Question:"]
  max_gen_toks: 10
  do_sample: false
filter_list:
  - name: number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    (root / "kvsieve_mc.yaml").write_text(f"""\
task: kvsieve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
metadata:
  version: 1.0
""")
    return root


def test_kvsieve_is_registered_with_the_harness():
    assert get_model("kvsieve") is KVSieveLM
    try:
        dist = metadata.distribution("kvsieve")
    except metadata.PackageNotFoundError:
        pytest.skip("kvsieve is not installed (source tree on PYTHONPATH): no entry points to check")
    source = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if source.startswith("file://") and Path(source[len("file://"):]).resolve() != Path(__file__).resolve().parents[1]:
        pytest.skip(f"kvsieve is installed from another checkout ({source}): its entry points are that one's")
    points = [ep for ep in dist.entry_points if ep.group == "lm_eval.models"]
    assert [(ep.name, ep.value) for ep in points] == [("kvsieve", "kvsieve.eval.lmeval:KVSieveLM")]
    assert points[0].load() is KVSieveLM


def test_harness_runs_generation_and_multiple_choice_with_a_compressed_cache(smollm, task_dir):
    results = lm_eval.simple_evaluate(
        model="kvsieve", model_args="pretrained=smollm2-135m,method=tova,budget=16,dtype=float32,device=cpu",
        tasks=["kvsieve_arith", "kvsieve_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),  # no index of 10k built-ins
        batch_size=4, log_samples=True, bootstrap_iters=0)
    arith, mc = results["results"]["kvsieve_arith"], results["results"]["kvsieve_mc"]
    assert 0.0 < arith["exact_match,number"] <= 1.0  # SmolLM2-135M gets 2 + 3 (and 4 + 4) right
    assert 0.0 <= mc["acc,none"] <= 1.0
    texts = [s["resps"][0][0] for s in results["samples"]["kvsieve_arith"]]
    assert len(texts) == len(ARITH) and any(t.strip() for t in texts)
    assert not any("\n" in t or "Question:" in t for t in texts)  # cut at the task's `until`
    assert len(results["samples"]["kvsieve_mc"]) == len(MC)
    info = results["config"]["kvsieve"]
    assert info["policy"]["method"] == "tova" and info["policy"]["budget"] == 16
    gen, ll = info["kv_stats"]["generate_until"], info["kv_stats"]["loglikelihood"]
    assert gen["requests"] == len(ARITH) and gen["compressed_requests"] == len(ARITH)  # the few-shot prompt > 16
    # the prompt is prefilled whole (peak), then cut to the budget (tova: interval 1)
    assert gen["final_kv_tokens_per_head"] <= 16 + 1 < gen["peak_kv_tokens_per_head"]
    assert gen["mean_final_kv_fraction_of_full"] < 0.5 and gen["compression_events"] >= len(ARITH)
    assert ll["requests"] == sum(len(c) for _, c, _ in MC)
    json.dumps(results["config"])  # the harness writes it to its results file


@pytest.fixture(scope="module")
def lms(smollm):
    model, tokenizer = smollm
    return {name: KVSieveLM(pretrained=model, tokenizer=tokenizer, **kw) for name, kw in {
        "full": {}, "roomy": dict(method="tova", budget=512), "tight": dict(method="tova", budget=12)}.items()}


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_generation_follows_the_harness_gen_kwargs(lms):
    lm = lms["full"]
    assert lm._gen_settings({"until": "Q:", "max_gen_toks": 5})[:3] == (("Q:",), 5, 0.0)
    assert lm._gen_settings({})[:3] == ((), lm.max_gen_toks, 0.0)  # greedy by default
    assert lm._gen_settings({"do_sample": True})[2] == 1.0
    assert lm._gen_settings({"do_sample": False, "temperature": 0.7})[2] == 0.0
    assert lm._gen_settings({"temperature": 0.5, "top_p": 0.9, "top_k": 20})[2:5] == (0.5, 0.9, 20)
    sampled = {"do_sample": True, "temperature": 1.0, "max_gen_toks": 6}
    texts = lm.generate_until(_requests("generate_until", [("Once upon a time", sampled), ("Hi", {"max_gen_toks": 4})]))
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts) and texts[0].strip()
    assert 0 < lm.kv_stats["generate_until"]["tokens"] <= 6 + 4
    with pytest.raises(ValueError, match="for method 'full'"):
        KVSieveLM(pretrained=lm.model, tokenizer=lm.tokenizer, budget=64)


def test_loglikelihood_through_the_compressed_cache_matches_full_when_nothing_is_evicted(lms, smollm):
    import kvsieve

    model, tokenizer = smollm
    context = "The capital of France is Paris. The capital of Italy is"
    greedy = kvsieve.generate(model, tokenizer, [context], None,
                              kvsieve.GenerateConfig(max_new_tokens=3, chat_template=False, ignore_eos=True))
    continuation = tokenizer.decode(greedy.token_ids[0])
    args = [(context, continuation), (context, " a banana split"), ("", "Hello there, friend.")]
    full = lms["full"].loglikelihood(_requests("loglikelihood", args))
    roomy = lms["roomy"].loglikelihood(_requests("loglikelihood", args))
    assert [g for _, g in full] == [True, False, False] == [g for _, g in roomy]
    for (a, _), (b, _) in zip(full, roomy):
        assert a < 0 and b == pytest.approx(a, abs=2e-3)
    text = [("The quick brown fox jumps over the lazy dog. " * 3,)]
    rolled = [lms[n].loglikelihood_rolling(_requests("loglikelihood_rolling", text))[0] for n in ("full", "roomy")]
    assert rolled[0] < 0 and rolled[1] == pytest.approx(rolled[0], abs=5e-3)
    assert lms["roomy"].kv_stats["loglikelihood"]["compression_events"] == 0

    tight = lms["tight"]
    long_context = context + " Rome. The capital of Spain is Madrid. The capital of Germany is"
    (score, _), = tight.loglikelihood(_requests("loglikelihood", [(long_context, " Berlin")]))
    assert score < 0
    stats = tight.kv_stats["loglikelihood"]
    assert stats["compression_events"] > 0 and stats["peak_kv_tokens_per_head"] <= 12 + 1  # streamed: never over


def test_lm_eval_command_runs_the_kvsieve_model(smollm, task_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvsieve.cli import app

    init = TaskManager.__init__  # the harness's CLI indexes its ~10k built-in tasks first: ~10 s saved
    monkeypatch.setattr(TaskManager, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "include_defaults": False}))

    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "lm-eval", "run", "--model", "kvsieve", "--model_args", "pretrained=smollm2-135m,method=streaming,budget=16",
        "--tasks", "kvsieve_arith", "--include_path", str(task_dir), "--limit", "1", "--output_path", str(out)])
    assert result.exit_code == 0, result.output
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert "exact_match,number" in saved["results"]["kvsieve_arith"]
    assert saved["config"]["kvsieve"]["policy"]["method"] == "streaming"
    assert saved["config"]["kvsieve"]["kv_stats"]["generate_until"]["requests"] == 1
