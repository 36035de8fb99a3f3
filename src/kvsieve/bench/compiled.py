"""Compiled-step benchmark: kvsieve's decode session, eager and compiled, against transformers'
own ``generate``, eager and with its static cache compiled, in one run.

Every entry decodes the same prompts for ``--new-tokens`` tokens per row (EOS ignored, greedy).
Compile time is its own column: transformers' static ``generate`` is compiled by a first,
untimed call of the same size (its compiled forward is kept on the model; its compile time is
that call's wall time less the timed call's); kvsieve's is the time of the steps that compiled
a graph (``RowStats.compile_s``), and its timed call is the first one.
Tokens/s is every row's new tokens over the timed call's wall time less compile time, prefill
included for every entry alike.  Ratios are against transformers' eager ``generate`` and
kvsieve's eager ``full`` measured in the same run.

    kvsieve bench compiled --new-tokens 1024 --batches 1,32 --threads 2
"""

from __future__ import annotations

import time

import torch

from ..attention import cache_kwarg_name
from ..cache import DEAD_POS
from ..generate import GenerateConfig, encode_prompts, left_pad
from .common import machine, prompts, report, timed_generate
from .settings import CompiledSettings, numbers, with_full


def hf_generate(model, tok, batch: int, new_tokens: int, static: bool) -> dict:
    """transformers' ``generate`` (eager dynamic cache, or compiled static cache): batch-level figures."""
    from transformers import CompileConfig, StaticCache

    # The prompts kvsieve's entries decode, encoded and left-padded by the same functions, so
    # both see the same tokens (and random:SHAPE models' byte tokenizer needs no batch encoding).
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    input_ids, positions = left_pad(encode_prompts(tok, prompts(batch), GenerateConfig()), pad_id, model.device)
    enc = {"input_ids": input_ids, "attention_mask": (positions != DEAD_POS).long()}
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    compile_s = 0.0
    if static:
        config = CompileConfig(fullgraph=True, mode="default", dynamic=False)  # as kvsieve's (dynamic recompiles)
        config._compile_all_devices = True  # transformers compiles on CUDA only unless told
        length = input_ids.shape[1] + new_tokens

        def static_kwargs():
            return {**kwargs, "compile_config": config,
                    cache_kwarg_name(model): StaticCache(config=model.config, max_cache_len=length)}

        # A whole first call compiles; its wall time less the timed call's is the compile time.
        t0 = time.perf_counter()
        model.generate(**enc, **static_kwargs())
        compile_s = time.perf_counter() - t0
        kwargs = static_kwargs()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**enc, **kwargs)
        wall = time.perf_counter() - t0
    generated = batch * (out.shape[1] - input_ids.shape[1])
    compile_s = max(compile_s - wall, 0.0)
    return {"entry": "transformers static compiled" if static else "transformers eager", "batch": batch,
            "generated_tokens": generated, "wall_s": wall, "compile_s": compile_s, "tokens_per_s": generated / wall}


def kvsieve_generate(model, tok, method: str, budget: int, batch: int, new_tokens: int, compile: bool) -> dict:
    row = timed_generate(model, tok, method, budget, batch, new_tokens, compile=compile)
    label = method if method == "full" else f"{method}@{budget}"
    timed = row["wall_s"] - row["compile_s"]
    return {"entry": f"kvsieve {label} {'compiled' if compile else 'eager'}", "batch": batch,
            "generated_tokens": row["generated_tokens"], "wall_s": row["wall_s"], "compile_s": row["compile_s"],
            "tokens_per_s": row["generated_tokens"] / timed, "peak_kv_bytes": row["peak_kv_bytes"]}


def measure(model, tok, batch: int, args: CompiledSettings) -> list[dict]:
    rows = []

    def add(row):
        rows.append(row)
        print(f"  batch {batch:>3} {row['entry']:34s} {row['tokens_per_s']:8.1f} tok/s   compile "
              f"{row['compile_s']:6.1f} s", flush=True)

    add(hf_generate(model, tok, batch, args.new_tokens, static=False))
    if not args.skip_transformers_static:
        add(hf_generate(model, tok, batch, args.new_tokens, static=True))
    for method in with_full(args.methods):
        for compile in (False, True):
            add(kvsieve_generate(model, tok, method, args.budget, batch, args.new_tokens, compile))
    hf = rows[0]["tokens_per_s"]
    full = next(r["tokens_per_s"] for r in rows if r["entry"] == "kvsieve full eager")
    for r in rows:
        r["vs_transformers_eager"] = r["tokens_per_s"] / hf
        r["vs_kvsieve_full_eager"] = r["tokens_per_s"] / full
    return rows


def draw(ax, rows: list[dict]) -> None:
    """Tokens/s of every entry relative to transformers' eager generate, one bar group per batch."""
    batches = sorted({r["batch"] for r in rows})
    entries = list(dict.fromkeys(r["entry"] for r in rows))
    width = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        by_entry = {r["entry"]: r for r in rows if r["batch"] == batch}
        ax.barh([j + i * width for j in range(len(entries))],
                [by_entry[e]["vs_transformers_eager"] if e in by_entry else 0 for e in entries],
                height=width, label=f"batch {batch}")
    ax.set_yticks([j + 0.4 - width / 2 for j in range(len(entries))], entries, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("tokens/s vs transformers' eager generate (same run)")
    ax.legend(fontsize=7)


def run(model, tok, args: CompiledSettings) -> list[dict]:
    """Every entry at every one of ``--batches`` on a loaded model; prints the table, writes JSON and PNG."""
    timed_generate(model, tok, "full", None, 1, 8)  # warm-up of the eager paths
    rows = []
    for batch in numbers(args.batches):
        print(f"batch {batch}:", flush=True)
        rows += measure(model, tok, batch, args)
    header = f"{'batch':>5} {'entry':34} {'tok/s':>8} {'x hf eager':>10} {'x full eager':>12} {'compile s':>9}"
    report(args, "compiled", machine(model), rows, header,
           lambda r: (f"{r['batch']:>5} {r['entry']:34} {r['tokens_per_s']:8.1f} {r['vs_transformers_eager']:10.2f} "
                      f"{r['vs_kvsieve_full_eager']:12.2f} {r['compile_s']:9.1f}"), draw)
    return rows

