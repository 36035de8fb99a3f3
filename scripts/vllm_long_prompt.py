"""A prompt longer than the KV pool (issue 59 item 3): plain vLLM against kvsieve's methods, one
engine per run, stepped in-process so the blocks the request holds are read after every step.

    PYTHONPATH=src .vllm-env/bin/python scripts/vllm_long_prompt.py --prompt-tokens 6000 \\
        --pool-tokens 2048 --chunk 1024 --methods snapkv,tova,h2o --out results/vllm-long-prompt.json

The prompt is GSM8K test questions (``../shared/data/gsm8k_test.jsonl``) joined until it holds
``--prompt-tokens`` tokens, then ``Answer: Let's think step by step.``; greedy, ``--new-tokens``
out, EOS ignored.  The pool is ``--pool-tokens`` (with vLLM's null block), vLLM's prefill chunk
``--chunk`` (``max_num_batched_tokens``).  Per run: whether the engine started (plain vLLM's own
start-up check refuses a pool smaller than one request of ``--max-model-len``), the tokens out,
the finish reason, the peak of blocks in use, the compactions, and whether every block was back.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm_capacity import TOKEN_BYTES, close, engine_parts  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k_test.jsonl"


def long_prompt(tokenizer, tokens: int) -> str:
    """GSM8K questions joined until the text holds ``tokens`` tokens, then the answer cue."""
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines() if line.strip()]
    text, ids = "", []
    for q in questions:
        text += f"Question: {q}\n"
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= tokens:
            break
    return tokenizer.decode(ids[:tokens]) + "\nAnswer: Let's think step by step."


def run(method: str, args, prompt: str) -> dict:
    from vllm import LLM, SamplingParams

    from kvsieve.models import ensure_bundled
    from kvsieve.vllm import engine_kwargs

    extra = {"enable_prefix_caching": False} if method == "plain" else engine_kwargs(method, args.budget)
    blocks = args.pool_tokens // args.block_size
    result = {"method": method, "budget": None if method == "plain" else args.budget}
    try:
        llm = LLM(model=str(ensure_bundled("smollm2-135m")), dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=4,
                  max_num_batched_tokens=args.chunk, kv_cache_memory_bytes=blocks * args.block_size * TOKEN_BYTES,
                  **extra)
    except Exception as err:  # noqa: BLE001: plain vLLM's start-up refusal is a result here
        return {**result, "started": False, "error": " ".join(str(err).split())[:400]}
    engine, scheduler, pool = engine_parts(llm)
    total = pool.num_gpu_blocks - 1
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True))
    peak, out, start = 0, None, time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
        peak = max(peak, total - pool.get_num_free_blocks())
    result.update(started=True, prompt_tokens=len(out.prompt_token_ids), tokens_out=len(out.outputs[0].token_ids),
                  finish_reason=out.outputs[0].finish_reason, peak_blocks=peak, pool_blocks=total,
                  compactions=scheduler.sieve_stats["compactions"], all_blocks_back=pool.get_num_free_blocks() == total,
                  wall_s=round(time.perf_counter() - start, 1))
    close(llm)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="snapkv,tova,h2o")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pool-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=1024, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--out", default="results/vllm-long-prompt.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from kvsieve.models import ensure_bundled

    prompt = long_prompt(AutoTokenizer.from_pretrained(str(ensure_bundled("smollm2-135m"))), args.prompt_tokens)
    runs = []
    for method in ["plain", *args.methods.split(",")]:
        runs.append(run(method, args, prompt))
        print(json.dumps(runs[-1]), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
