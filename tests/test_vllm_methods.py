"""kvsieve's methods served inside a real vLLM engine (bundled SmolLM2-135M, fp32, eager, greedy).

* exactness: with a budget at least the sequence length nothing is evicted, and every served
  method gives plain vLLM's tokens (the recorder, the settings and the worker's path in place);
* two engines: at a budget below the length, vLLM + kvsieve gives kvsieve's own engine's tokens
  (``scripts/vllm_two_engines.py``, run small);
* SkipKV's sentences, fed by the worker, against kvsieve's engine (default);
* a compaction right after a preemption's recompute.

Needs the vLLM environment; skipped where vLLM is not installed:

    PYTHONPATH=src /work/vllm-env/bin/python -m pytest -q tests/test_vllm_methods.py          # default
    PYTHONPATH=src /work/vllm-env/bin/python -m pytest -q -m slow tests/test_vllm_methods.py  # the rest

Each engine starts in about 30 s on a quiet machine (2 cores), hence few default tests.
"""

import gc
import os

import pytest

from vllm_support import load_script, model_dir, require_vllm, run_script

require_vllm()

from kvsieve.vllm import engine_kwargs  # noqa: E402

PROMPTS = ["The history of the printing press begins", "In mathematics, a prime number is"]
NEW_TOKENS, BLOCK = 48, 32
STATS = "<calibrated>"  # triattention's statistics: the tri_stats fixture's (calibrated on the bundled model)
# each served method with the settings it needs on the bundled model: the two-engine script's, and the two
# it leaves out there (random's draws depend on the store's size; triattention needs statistics)
SERVED = {**{m: s for m, s in load_script("vllm_two_engines").METHODS.items() if "@" not in m}, "random": {},
          "triattention": {"options": {"stats": STATS}},  # its defaults: per_head across layers, the prompt pinned
          # LagKV's L and r fitted to the budget at max_model_len (512): nothing is compressed below S + 2L = 272
          "lagkv": {}, "localkv": {"budget": None},  # localkv at its own L = 128, r = 1/4: the same
          "lagkv-l2": {"options": {"skip_layers": 0}}}
DEFAULT = {"h2o"}  # records every query of a request: the largest ring


def _greedy(kvsieve: dict | None, n: int = NEW_TOKENS, **engine):
    """Greedy tokens of an in-process engine (kvsieve's classes with ``kvsieve`` settings), and its scheduler's stats."""
    from vllm import LLM, SamplingParams

    extra = engine_kwargs(**kvsieve) if kvsieve else {"enable_prefix_caching": False}
    llm = LLM(model=model_dir(), dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=512,
              max_num_seqs=4, kv_cache_memory_bytes=64 << 20, seed=0, **{**extra, **engine})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    stats = dict(getattr(llm.llm_engine.engine_core.engine_core.scheduler, "sieve_stats", {}))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.fixture(scope="module")
def tri_stats(tmp_path_factory):
    """TriAttention statistics of the bundled model from a few GSM8K-like lines (seconds), or the
    file named by KVSIEVE_TRIATTENTION_STATS."""
    if os.environ.get("KVSIEVE_TRIATTENTION_STATS"):
        return os.environ["KVSIEVE_TRIATTENTION_STATS"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvsieve.analysis.qk import calibrate

    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype="float32")
    tok = AutoTokenizer.from_pretrained(model_dir())
    texts = ["Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether. #### 72",
             "Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10. #### 10"]
    path = tmp_path_factory.mktemp("tri") / "smol.pt"
    calibrate(model, tok, texts * 4, tokens=256, chunk=128).save(path)
    return str(path)


def _settings(method: str, request) -> dict:
    """The method's settings of ``SERVED``, its statistics file filled in."""
    settings = SERVED[method]
    if settings.get("options", {}).get("stats") == STATS:
        settings = {**settings, "options": {**settings["options"], "stats": request.getfixturevalue("tri_stats")}}
    return settings


@pytest.fixture(scope="module")
def plain():
    return _greedy(None)[0]


@pytest.mark.parametrize("method", [pytest.param(m, marks=() if m in DEFAULT else pytest.mark.slow) for m in SERVED])
def test_a_budget_above_the_length_gives_plain_vllms_tokens(plain, method, request):
    tokens, stats = _greedy({"method": method, "budget": 400, "interval": 8, **_settings(method, request)})
    assert stats["compactions"] == 0  # nothing over the budget: the served path must change nothing
    assert tokens == plain


@pytest.mark.slow
def test_two_engines_agree_beyond_the_first_compaction(tmp_path):
    """``scripts/vllm_two_engines.py`` on 3 GSM8K prompts: on every row where the two engines' full
    caches agree, the deterministic methods (StreamingLLM's positions, Knorm's key norms) and TOVA
    give kvsieve's tokens past the first compaction, and StreamingLLM's to the end."""
    result = run_script("vllm_two_engines", tmp_path, "--methods", "streaming,knorm,tova", "--prompts", "3",
                        "--new-tokens", "48")
    agree = [i for i, same in enumerate(result["baseline_full"]["identical"]) if same]
    assert agree, "no row where plain vLLM and kvsieve's full agree: nothing to compare against"
    for method, row in result["methods"].items():
        assert row["compactions"] > 0, method
        for i in agree:
            at = row["first_compaction"][i]
            assert at is not None and row["first_divergence"][i] > at, (method, i, row)
    assert all(result["methods"]["streaming"]["identical"][i] for i in agree)


def test_skipkvs_sentences_fed_by_vllms_worker_give_kvsieves_tokens(tmp_path):
    """SkipKV on 8 GSM8K prompts at budget 64 every 16 steps, tau 0.5 so that Eq. 3 flags sentences:
    the worker's sentence table, fed from vLLM's forwards, gives kvsieve's engine's tokens on every
    row where the two engines' full caches agree, past the first compaction.  In kvsieve's engine
    Eq. 6's penalty changes the tokens of rows 5 and 7 here (against tau 1, where no sentence is
    flagged: results/skipkv-penalty-rows.json), so a worker that fed no sentence would part there."""
    result = run_script("vllm_two_engines", tmp_path, "--methods", "skipkv@tau0.5", "--prompts", "8",
                        "--new-tokens", "64", "--interval", "16")
    row = result["methods"]["skipkv@tau0.5"]
    agree = [i for i, same in enumerate(result["baseline_full"]["identical"]) if same]
    assert agree and row["compactions"] > 0 and row["settings"]["tau"] == 0.5
    assert all(row["identical"][i] and row["first_compaction"][i] is not None for i in agree), row


@pytest.mark.slow
def test_caotes_block_wise_prefill_at_vllms_chunks_is_kvsieves(tmp_path):
    """CAOTE over TOVA with blocks of 32 (vLLM's prefill chunks, engine_kwargs' threshold) on 3
    GSM8K prompts at budget 32: prompts are compressed between chunks (more compactions than with
    the prompt compressed whole), and every row where the two engines' full caches agree is
    kvsieve's engine's, run one prompt at a time (its blocks from each prompt's first token)."""
    result = run_script("vllm_two_engines", tmp_path, "--methods", "caote:tova@b32,caote:tova@whole", "--prompts", "3",
                        "--budget", "32", "--new-tokens", "24", "--interval", "8")
    blocks, whole = result["methods"]["caote:tova@b32"], result["methods"]["caote:tova@whole"]
    assert blocks["engine"] == "one prompt at a time" and blocks["compactions"] > whole["compactions"]
    assert blocks["identical_where_full_agrees"] == 1.0 and whole["identical_where_full_agrees"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["tova", "skipkv"])
def test_a_compaction_right_after_a_preemptions_recompute(method):
    """A pool too small for every request even compressed: vLLM preempts some; each recomputes its
    prompt and outputs at full length and is compressed at once by TOVA (which scores with the
    recomputed request's recorded last query) or SkipKV (whose sentences the recompute feeds anew),
    then finishes with every token."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir(), dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=20 * BLOCK,
              kv_cache_memory_bytes=21 * 30 * 3 * 64 * 2 * 4 * BLOCK, seed=0,
              **engine_kwargs(method, budget=64, interval=16))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    for i in range(9):
        engine.add_request(f"p{i}", PROMPTS[i % 2], SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True))
    finished, preempted, answered = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
        preempted = max(preempted, sum(r.num_preemptions for r in scheduler.requests.values()))
        answered = max(answered, sum(scheduler.sieve_preemptions.values()))
    free, total = pool.get_num_free_blocks(), pool.num_gpu_blocks - 1
    engine.engine_core.shutdown()
    assert preempted > 0 and answered > 0  # a recompute was compressed at once
    assert finished == {f"p{i}": 160 for i in range(9)}
    assert free == total
