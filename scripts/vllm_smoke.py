"""Smoke run of vLLM on the bundled model, plain or with kvsieve's plugin classes (issue 49).

Run it from the vLLM environment (not the project's .venv):

    PYTHONPATH=src /work/vllm-env/bin/python scripts/vllm_smoke.py --model "$(.venv/bin/kvsieve models path smollm2-135m)"
    PYTHONPATH=src /work/vllm-env/bin/python scripts/vllm_smoke.py --model ... --kvsieve

It prints one JSON object: the engine start time, greedy tokens/s at each batch, the first
prompt's text, and (with --kvsieve) whether the tokens equal a plain run's saved with --save.
The engine core is a spawned process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROMPTS = [
    "The history of the printing press begins",
    "A short guide to growing tomatoes: first,",
    "In mathematics, a prime number is",
    "The capital of France is Paris. The capital of Italy is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three laws of thermodynamics state that",
    "To make a cup of tea, you need",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV cache space (explicit: skips warm-up)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kvsieve", action="store_true", help="use kvsieve's scheduler and worker classes")
    ap.add_argument("--method", default="full", help="with --kvsieve: full or streaming")
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--interval", type=int, default=None)
    ap.add_argument("--record-queries", type=int, default=0, help="with --kvsieve: queries recorded per layer")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (CPU: a multiple of 32)")
    ap.add_argument("--save", help="write the token ids to this JSON file")
    ap.add_argument("--compare", help="compare the token ids with this JSON file")
    ap.add_argument("--out", help="also write the result JSON to this file (vLLM logs to stdout too)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        enable_prefix_caching=False,
        seed=0,
    )
    if args.kvsieve:
        from kvsieve.vllm import engine_kwargs

        kwargs.update(engine_kwargs(args.method, args.budget, interval=args.interval,
                                    record_queries=args.record_queries))
    if args.block_size:
        kwargs["block_size"] = args.block_size
    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    llm = LLM(**kwargs)
    t_start = time.perf_counter() - t1

    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    result: dict = {
        "kvsieve": args.kvsieve and {"method": args.method, "budget": args.budget, "interval": args.interval,
                                     "record_queries": args.record_queries},
        "block_size": args.block_size,
        "import_s": round(t_import, 1),
        "engine_start_s": round(t_start, 1),
        "new_tokens": args.new_tokens,
        "batches": {},
    }
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm
    tokens: dict[str, list[list[int]]] = {}
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = (PROMPTS * ((b + len(PROMPTS) - 1) // len(PROMPTS)))[:b]
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        result["batches"][str(b)] = {"seconds": round(dt, 2), "tokens": n, "tokens_per_s": round(n / dt, 1)}
        tokens[str(b)] = [list(o.outputs[0].token_ids) for o in outs]
        if len(outs) > len(tokens.get("prompt_token_ids", [])):
            tokens["prompt_token_ids"] = [list(o.prompt_token_ids) for o in outs]
        if "text" not in result:
            result["text"] = outs[0].prompt + outs[0].outputs[0].text
    if args.save:
        with open(args.save, "w") as f:
            json.dump(tokens, f)
    if args.compare:
        with open(args.compare) as f:
            ref = json.load(f)
        result["same_tokens_as_reference"] = {b: tokens.get(b) == ref.get(b) for b in ref if b != "prompt_token_ids"}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
