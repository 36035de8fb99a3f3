"""Two engines, one method (issue 49): vLLM + kvsieve against kvsieve's own transformers engine.

For each method, the same GSM8K prompts (token ids), the same budget, interval, sinks and recent
window, greedy fp32 decoding of the bundled SmolLM2-135M: vLLM with kvsieve's classes
(``kvsieve.vllm.engine_kwargs``) and ``kvsieve.generate`` with the policy those settings build
(``SieveSettings.policy``, so both run the very same ``Policy``).  Per row it reports the tokens
equal until the first divergence and whether the row is identical to the end; per method the
share of identical rows, the rows where the first compaction came before the first divergence,
and the compactions vLLM ran.  A baseline compares plain vLLM with kvsieve's ``full``: the two
engines' kernels round differently, so rows can part without any eviction, and a method's rows
are read against it.

Run from the vLLM environment (the engine core runs in this process, to read its scheduler):

    PYTHONPATH=src /work/vllm-env/bin/python scripts/vllm_two_engines.py \\
        --prompts 20 --new-tokens 64 --out results/vllm-two-engines.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

DATA = os.environ.get("KVSIEVE_SHARED_DATA", "/work/shared/data")
# method -> its own settings for this comparison: knorm without its two whole layers (a shared
# block table cannot hold them), windows small enough for a budget of 64 with room to evict; LagKV
# at a budget of 128 (64 fits only one token per partition at this horizon, off its paper's grid
# anyway: off_grid) and LocalKV without one (L = 32: the prompt is compressed, then every 32 tokens)
METHODS = {
    "streaming": {},
    "knorm": {"options": {"skip_layers": 0}},
    "keydiff": {},
    "expected": {},
    "snapkv": {"options": {"window": 8}},
    "rkv": {},
    "tova": {},
    "h2o": {},
    "lazy": {},
    "raas": {},
    "ams:expected": {},
    "ams:tova": {},  # the served benchmark's AMS
    "lagkv": {"budget": 128, "options": {"off_grid": True}},
    "localkv": {"budget": None, "options": {"lag": 32}},
    # CAOTE on TOVA's scores, FastCAOTE on H2O's: the prompt read in blocks of 128 (vLLM's prefill chunks,
    # engine_kwargs' long_prefill_token_threshold), and (@whole) compressed once after prefill
    "caote:tova": {},
    "fastcaote:h2o": {},
    # blocks of 32 (CAOTE's block m is a setting): GSM8K prompts of 38-122 tokens span several
    "caote:tova@b32": {"options": {"prefill_block": 32}},
    "fastcaote:h2o@b32": {"options": {"prefill_block": 32}},
    "caote:tova@whole": {"options": {"prefill_block": False}},
    "fastcaote:h2o@whole": {"options": {"prefill_block": False}},
    # SkipKV's sentences fed by vLLM's worker (its default tau 0.95); @tau0.5: more sentences in P, Eq. 3's penalty
    # on more tokens
    "skipkv": {},
    "skipkv@tau0.5": {"options": {"tau": 0.5}},
}
BLOCK = 32


PROMPT = "Question: {question}\nAnswer: Let's think step by step."


def chosen(ap: argparse.ArgumentParser, names: str, table: dict[str, dict], stats: str | None) -> dict[str, dict]:
    """Each method of ``names`` (comma-separated) with its settings from ``table``, TriAttention's
    with its statistics file ``stats`` (its defaults, and ``triattention@per_layer``: every kv
    head of a layer keeping the same tokens); ``ap.error`` for a name not there."""
    if stats:
        table = {**table, "triattention": {"options": {"stats": stats}},
                 "triattention@per_layer": {"options": {"stats": stats, "pruning": "per_layer"}}}
    unknown = [m for m in names.split(",") if m not in table]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(table)} "
                 "(triattention needs --triattention-stats)")
    return {m: table[m] for m in names.split(",")}


def gsm8k_texts(n: int) -> list[str]:
    """The first ``n`` GSM8K test questions, each as a plain question/answer prompt (``PROMPT``)."""
    rows = []
    with open(os.path.join(DATA, "gsm8k_test.jsonl")) as f:
        for line in f:
            rows.append(PROMPT.format(question=json.loads(line)["question"]))
            if len(rows) == n:
                break
    return rows


def gsm8k_prompts(tokenizer, n: int) -> list[list[int]]:
    """``gsm8k_texts(n)`` as token ids."""
    return [tokenizer(text).input_ids for text in gsm8k_texts(n)]


def first_divergence(a: list[int], b: list[int]) -> int:
    """Tokens equal from the start (len(a) when the rows are identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def first_compaction(settings, prompt_len: int, new_tokens: int) -> int | None:
    """Index of the first output token whose forward pass read a compacted KV (None: none did),
    by the scheduler's own rule (``plan.keep_count``): a compaction before the step that writes
    decode token s (s generated tokens in the KV) first shows in output token s + 1."""
    from kvsieve.vllm.plan import keep_count

    for s in range(new_tokens - 1):
        if keep_count(settings, prompt_len + s, s, prompt_len=prompt_len) is not None:
            return s + 1
    return None


def vllm_tokens(model_dir: str, prompts, new_tokens: int, config: dict | None, max_model_len: int, **engine):
    """Greedy tokens of vLLM (kvsieve's classes when ``config`` is given) and the compactions run;
    ``engine``: more of ``vllm.LLM``'s options (``tensor_parallel_size``)."""
    from vllm import LLM, SamplingParams

    from kvsieve.vllm import engine_kwargs

    extra = engine_kwargs(**config) if config else {"enable_prefix_caching": False}
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=max_model_len,
              max_num_seqs=len(prompts), kv_cache_memory_bytes=256 << 20, seed=0, **extra, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    compactions = getattr(core.scheduler, "sieve_stats", {}).get("compactions", 0)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], compactions


def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    firsts = [first_divergence(a, b) for a, b in zip(ours, theirs)]
    identical = [a == b for a, b in zip(ours, theirs)]
    return {"first_divergence": firsts, "identical": identical,
            "identical_share": sum(identical) / len(identical),
            "mean_first_divergence": sum(firsts) / len(firsts)}


def save(result: dict, out: str | None) -> None:
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated, from: " + ", ".join(METHODS) + ", triattention (NAME@label: NAME with "
                         "other settings)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--out", default="results/vllm-two-engines.json")
    ap.add_argument("--triattention-stats", default=None, metavar="FILE",
                    help="TriAttention's statistics of the bundled model (kvsieve calibrate triattention): "
                         "with it, --methods may name triattention (its official defaults)")
    args = ap.parse_args()
    methods = chosen(ap, args.methods, METHODS, args.triattention_stats)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the scheduler's counters
    import torch

    from kvsieve.generate import GenerateConfig, generate
    from kvsieve.models import ensure_bundled, load_model
    from kvsieve.vllm.plan import SieveSettings

    t0 = time.perf_counter()
    model_dir = str(ensure_bundled("smollm2-135m"))
    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m", device="cpu", dtype="float32")
    prompts = gsm8k_prompts(tok, args.prompts)
    max_model_len = max(map(len, prompts)) + args.new_tokens + BLOCK
    config = GenerateConfig(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    plain, _ = vllm_tokens(model_dir, prompts, args.new_tokens, None, max_model_len)
    full = generate(model, tok, prompts, config=config).token_ids
    result = {"model": "smollm2-135m", "dtype": "float32", "prompts": len(prompts), "data": "gsm8k_test.jsonl",
              "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens, "budget": args.budget,
              "interval": args.interval, "block_size": BLOCK,
              "baseline_full": compare(plain, full), "methods": {}}
    agree = [i for i, same in enumerate(result["baseline_full"]["identical"]) if same]
    for method in methods:
        # horizon: LagKV's budget fit (the server's max_model_len by default) is kvsieve's for this batch
        cfg = {"method": method.split("@")[0], "budget": args.budget, "interval": args.interval,
               "horizon": max(map(len, prompts)) + args.new_tokens, **methods[method]}
        settings = SieveSettings.from_config(cfg).for_model(model.config)
        started = time.perf_counter()
        try:
            ours, compactions = vllm_tokens(model_dir, prompts, args.new_tokens, cfg, max_model_len)
        except Exception as err:  # one method's failure is reported, not hidden, and the others still run
            result["methods"][method] = {"error": f"{type(err).__name__}: {err}"}
            print(json.dumps({method: result["methods"][method]}), flush=True)
            continue
        if settings.policy.prefill_block_size() is None:
            theirs = generate(model, tok, prompts, policy=settings.policy, config=config).token_ids
        else:  # block-wise prefill: a batch's blocks follow its padded layout, one prompt's start at its first token,
            # as vLLM's chunks do
            theirs = [generate(model, tok, [p], policy=settings.policy, config=config).token_ids[0] for p in prompts]
        row = compare(ours, theirs)
        row["engine"] = "batch" if settings.policy.prefill_block_size() is None else "one prompt at a time"
        row["settings"] = {k: v for k, v in settings.policy.settings().items() if not k.startswith("allocator_")}
        row["compactions"] = compactions
        row["first_compaction"] = [first_compaction(settings, len(p), args.new_tokens) for p in prompts]
        row["diverged_after_first_compaction"] = sum(
            1 for first, at in zip(row["first_divergence"], row["first_compaction"]) if at is not None and first > at)
        row["identical_where_full_agrees"] = sum(row["identical"][i] for i in agree) / max(1, len(agree))
        row["seconds"] = round(time.perf_counter() - started, 1)
        result["methods"][method] = row
        save(result, args.out)  # after every method: a long run leaves what it measured
        print(json.dumps({method: {k: row[k] for k in ("identical_share", "identical_where_full_agrees",
                                                        "mean_first_divergence", "compactions")}}), flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    save(result, args.out)
    print(json.dumps({"baseline_full_identical_share": result["baseline_full"]["identical_share"],
                      "seconds": result["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
