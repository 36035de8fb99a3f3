"""lm-evaluation-harness model ``kvsieve``: any harness task with a bounded KV cache.

Install with ``pip install 'kvsieve[lmeval]'``; then either of::

    kvsieve lm-eval run --model kvsieve --model_args pretrained=DIR,method=tova,budget=256 --tasks gsm8k
    python -m kvsieve.eval.lmeval run --model kvsieve --model_args pretrained=DIR,method=tova,budget=256 --tasks gsm8k

runs the harness's own command line (``run``, ``ls``, ``validate``; every harness option is
passed through) with this model registered.  ``lm-eval`` releases that discover plugins from
the ``lm_eval.models`` entry-point group (harness main branch from 2026-09; not yet 0.4.13) find
the model without the wrapper: ``lm-eval run --model kvsieve ...``.  lm-eval 0.4.13 and older
have no such discovery, so there the wrapper above, or ``import kvsieve.eval.lmeval`` before
``lm_eval.simple_evaluate(model="kvsieve", ...)``, is what registers it.

Model arguments (``--model_args k=v,k=v``):

``pretrained``  bundled name (``smollm2-135m``), local checkpoint directory or hub id; from
                Python also an already loaded model, with ``tokenizer=`` beside it
``method``      eviction method (``kvsieve methods``), default ``full``
``budget``      KV tokens kept per (row, kv head)
``allocator``   ``uniform``, ``pyramid`` or ``adakv``
``batch_size``  prompts decoded together (``--batch_size`` of the harness works too; ``auto`` -> 8)
``max_gen_toks`` / ``max_new_tokens``  generation limit when a task sets none (256)
``max_length``  longest sequence fed to the model (default: the model's position limit)
``device``, ``dtype``  as for ``kvsieve generate`` (``auto`` by default)
``prefill_chunk``  prompt tokens per prefill pass (default: the method's block size, else 512)
``sampling_seed``  seed of sampled (``do_sample``) generation
anything else   a setting of the method, passed to ``kvsieve.make_policy`` (``sinks``,
                ``recent``, ``interval``, ``window``, ``seed`` of ``random``, ``allocator_*``...)

What each request type measures:

``generate_until``  ``kvsieve.generate`` with the policy, batched: the prompt is prefilled with
    full attention, then compressed on the method's schedule while decoding.  ``until`` stop
    strings, ``max_gen_toks``, ``do_sample``/``temperature``/``top_p``/``top_k`` are honoured.
``loglikelihood`` / ``loglikelihood_rolling``
    ``full``: one batched forward pass of the plain model (exact log-probabilities).
    A compressed method: teacher forcing through the compressed cache with
    ``kvsieve.eval.perplexity.score_text`` (StreamingLLM / H2O language-modelling protocol: the
    first ``budget`` tokens are prefilled, the rest fed one token at a time, compressing on the
    method's schedule), so the context itself streams through the bounded cache.  The
    continuation's log-probability is score(context + continuation) - score(context); both runs
    see the same tokens and the same compression steps up to the end of the context, so the
    difference is the continuation's own log-probability under the compressed cache.  One token
    per forward pass: far slower than ``full`` on long contexts.
    ``is_greedy`` under a compressed method comes from greedy ``kvsieve.generate`` from the
    context's token ids (the ``generate_until`` regime: full prefill, then compression), since
    the teacher-forcing scorer reports sums only.

KV statistics (peak live tokens per kv head, compression events, peak bytes) of every request
are summed in ``KVSieveLM.kv_stats`` and written to the results under ``config.kvsieve``.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch
from tqdm.auto import tqdm

try:
    import lm_eval.models  # noqa: F401  (the built-in models first: the harness loads them only into an empty registry)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvsieve.eval.lmeval needs lm-evaluation-harness: pip install 'kvsieve[lmeval]'") from err

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256
# gen_kwargs keys read by generate_until; any other key is reported once and ignored
_GEN_KEYS = {"until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens", "do_sample",
             "temperature", "top_p", "top_k", "seed"}


class KVStats:
    """Running KV-cache statistics of one request type."""

    def __init__(self):
        self.requests = 0
        self.tokens = 0  # generated (generate_until) or scored (loglikelihood) tokens
        self.compression_events = 0
        self.compressed_requests = 0
        self.peak_kv_tokens_per_head = 0  # largest over requests of the largest layer (a full prefill included)
        self.final_kv_tokens_per_head = 0  # the same at each request's end
        self.peak_kv_bytes = 0
        self._peak_fraction = self._final_fraction = 0.0  # sums over requests of tokens per head / a full cache's

    def add(self, peak_kv_tokens: list[int], final_kv_tokens: list[int], kv_heads: int, full_tokens: int,
            tokens: int, compression_events: int, peak_kv_bytes: int) -> None:
        """One request: KV token counts per layer summed over kv heads (``RowStats`` units);
        ``full_tokens``: what a full cache would hold per kv head at the request's end."""
        peak = max(peak_kv_tokens, default=0) / max(kv_heads, 1)
        final = max(final_kv_tokens, default=0) / max(kv_heads, 1)
        self.requests += 1
        self.tokens += tokens
        self.compression_events += compression_events
        self.compressed_requests += int(compression_events > 0)
        self.peak_kv_tokens_per_head = max(self.peak_kv_tokens_per_head, int(round(peak)))
        self.final_kv_tokens_per_head = max(self.final_kv_tokens_per_head, int(round(final)))
        self.peak_kv_bytes = max(self.peak_kv_bytes, peak_kv_bytes)
        self._peak_fraction += peak / max(full_tokens, 1)
        self._final_fraction += final / max(full_tokens, 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "tokens": self.tokens, "compression_events": self.compression_events,
            "compressed_requests": self.compressed_requests,
            "peak_kv_tokens_per_head": self.peak_kv_tokens_per_head,
            "final_kv_tokens_per_head": self.final_kv_tokens_per_head, "peak_kv_bytes": self.peak_kv_bytes,
            # means over requests of KV tokens per head / what a full cache would hold (1.0: no saving)
            "mean_peak_kv_fraction_of_full": round(self._peak_fraction / self.requests, 4) if self.requests else None,
            "mean_final_kv_fraction_of_full": round(self._final_fraction / self.requests, 4) if self.requests else None,
        }


class ModelArgsError(ValueError):
    """A ``--model_args`` value the ``kvsieve`` model cannot take (``main`` prints it as one line)."""


def _ids_tokenizer(ids):
    """score_text's tokenizer contract (``tokenizer(text).input_ids``) for text that is already token ids."""
    return SimpleNamespace(input_ids=list(ids))


def _batch_size(value) -> int:
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE  # no memory probe: kvsieve's cache size is set by the budget
    size = int(value)
    if size < 1:
        raise ValueError(f"batch_size must be >= 1, got {value}")
    return size


@register_model("kvsieve") if __name__ != "__main__" else (lambda cls: cls)
class KVSieveLM(TemplateLM):
    """A Hugging Face causal LM whose KV cache is bounded by a kvsieve method (see the module doc)."""

    def __init__(self, pretrained="smollm2-135m", method: str = "full", budget: int | None = None,
                 allocator: str = "uniform", batch_size: int | str | None = None, max_batch_size=None,
                 max_gen_toks: int | None = None, max_new_tokens: int | None = None, max_length: int | None = None,
                 device: str | None = None, dtype: str = "auto", prefill_chunk: int | None = None,
                 sampling_seed: int = 0, tokenizer=None, **settings):
        super().__init__()
        from ..methods import make_policy
        from ..models import load_model

        if method == "full" and (settings or budget is not None):
            given = sorted(settings) + (["budget"] if budget is not None else [])
            raise ValueError(f"unknown model argument(s) {given} for method 'full' (no eviction, no settings)")
        self.policy = make_policy(method, budget=budget, allocator=allocator, **settings)  # bad settings: fail first
        if isinstance(pretrained, str):
            self.model, self.tokenizer = load_model(pretrained, device=device or "auto", dtype=dtype or "auto")
            self.pretrained = pretrained
        else:
            if tokenizer is None:
                raise ValueError("a loaded model as pretrained= needs its tokenizer as tokenizer=")
            self.model, self.tokenizer = pretrained.eval(), tokenizer
            self.pretrained = getattr(pretrained.config, "_name_or_path", type(pretrained).__name__)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._batch_size = _batch_size(batch_size)
        self._max_gen_toks = int(max_gen_toks or max_new_tokens or DEFAULT_MAX_GEN_TOKS)
        self._max_length = int(max_length) if max_length else None
        self.prefill_chunk = int(prefill_chunk or (self.policy.scorer.defaults.prefill_block if self.policy.scorer else 0) or 512)
        self.sampling_seed = int(sampling_seed)
        config = self._text_config()
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.compressed = self.policy.name != "full"
        self.stats = {"generate_until": KVStats(), "loglikelihood": KVStats()}
        self._warned: set[str] = set()
        bos = self.tokenizer.bos_token_id
        self._adds_bos = bos is not None and self.tokenizer("a").input_ids[:1] == [bos]

    def _text_config(self):
        config = self.model.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        # The harness passes --batch_size/--device beside model_args (its CLI always sends both,
        # device cuda:0 by default): a value given in model_args wins instead of colliding, and the
        # CLI's default CUDA device falls back to `auto` on a machine without CUDA, as its hf model does.
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            log.info("no CUDA device: kvsieve runs on the CPU instead of --device %s", extra.pop("device"))
        try:
            return cls(**arg_dict, **extra)
        except ValueError as err:  # a bad setting, an unknown argument or model name (ModelNotFoundError)
            raise ModelArgsError(f"kvsieve --model_args: {err}") from None

    # ------------------------------------------------------------------ harness properties
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        config = self._text_config()
        for attr in ("max_position_embeddings", "n_positions", "seq_length"):
            if getattr(config, attr, None):
                return int(getattr(config, attr))
        limit = getattr(self.tokenizer, "model_max_length", None)
        return int(limit) if limit and limit < 10**9 else 2048

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self):
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # None: the tokenizer's default, as kvsieve.generate and score_text encode prompts
        flag = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer(string, add_special_tokens=flag).input_ids

    @property
    def kv_stats(self) -> dict[str, dict]:
        return {name: s.as_dict() for name, s in self.stats.items() if s.requests}

    def get_model_info(self) -> dict:
        """Merged into the results' ``config`` by the harness, after the run."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "kvsieve": {"pretrained": self.pretrained, "policy": self.policy.settings(), "kv_stats": self.kv_stats},
        }

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # ------------------------------------------------------------------ generate_until
    def _gen_settings(self, gen_kwargs: dict) -> tuple:
        kwargs = dict(gen_kwargs or {})
        unknown = sorted(set(kwargs) - _GEN_KEYS)
        if unknown:
            self._warn_once("gen:" + ",".join(unknown), f"kvsieve ignores generation kwargs {unknown}")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        limit = next((kwargs[k] for k in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
                      if kwargs.get(k) is not None), self.max_gen_toks)
        temperature = float(kwargs.get("temperature") or 0.0)
        do_sample = kwargs.get("do_sample")
        if do_sample is None:
            do_sample = temperature > 0
        if not do_sample:
            temperature = 0.0
        elif "temperature" not in kwargs:
            temperature = 1.0  # sampling without a temperature: the distribution as is
        elif temperature == 0:
            self._warn_once("sample0", "do_sample=True with temperature=0: decoding greedily")
        return (tuple(until), int(limit), temperature, float(kwargs.get("top_p") or 1.0),
                int(kwargs.get("top_k") or 0), int(kwargs.get("seed") or self.sampling_seed))

    def _prompt(self, context: str, max_gen_toks: int) -> list[int]:
        """The prompt's token ids handed to kvsieve.generate (its end, when over max_length - max_gen_toks)."""
        if self._adds_bos and self.tokenizer.bos_token and context.startswith(self.tokenizer.bos_token):
            context = context[len(self.tokenizer.bos_token):]  # a chat template's BOS: the tokenizer adds its own
        ids = self.tok_encode(context) or [self.prefix_token_id]
        room = self.max_length - max_gen_toks
        if room < 1:
            raise ValueError(f"max_gen_toks {max_gen_toks} leaves no room for a prompt in max_length {self.max_length}")
        if len(ids) > room:
            self._warn_once("truncate", f"prompts over {room} tokens (max_length - max_gen_toks) lose their start")
            ids = ids[-room:]
        return ids

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from ..generate import GenerateConfig, generate

        outputs: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args[0], req.args[1]
            settings = self._gen_settings(gen_kwargs)
            groups[settings].append((i, self._prompt(context, settings[1])))
        bar = tqdm(total=len(requests), desc="kvsieve generate_until", disable=disable_tqdm)
        for (until, limit, temperature, top_p, top_k, seed), items in groups.items():
            config = GenerateConfig(max_new_tokens=limit, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                    stop_strings=until, prefill_chunk=self.prefill_chunk, chat_template=False)
            items.sort(key=lambda item: -len(item[1]))  # similar lengths together: less left padding
            for start in range(0, len(items), self.batch_size):
                batch = items[start:start + self.batch_size]
                result = generate(self.model, self.tokenizer, [ids for _, ids in batch], self.policy, config)
                for (i, _), text, stat in zip(batch, result.texts, result.stats):
                    outputs[i] = text
                    self.stats["generate_until"].add(stat.peak_kv_tokens, stat.final_kv_tokens, self.kv_heads,
                                                     stat.prompt_tokens + stat.generated_tokens, stat.generated_tokens,
                                                     stat.compression_events, stat.peak_kv_bytes)
                    self.cache_hook.add_partial("generate_until", (requests[i].args[0], requests[i].args[1]), text)
                bar.update(len(batch))
        bar.close()
        log.info("kvsieve %s generate_until KV stats: %s", self.policy.name, self.stats["generate_until"].as_dict())
        return outputs  # type: ignore[return-value]

    # ------------------------------------------------------------------ log-likelihoods
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, need_greedy: bool = True):
        """``requests``: ``((context, continuation) | None, context ids, continuation ids)``."""
        pieces = []  # (strings, context ids, continuation ids, context tokens cut off the front)
        for strings, ctx, cont in requests:
            ctx, cont = list(ctx), list(cont)[-(self.max_length + 1):]
            whole = (ctx + cont)[-(self.max_length + 1):]  # the model's window, as the harness's hf model does
            pieces.append((strings, whole[:len(whole) - len(cont)], cont, len(ctx) + len(cont) - len(whole)))
        if self.compressed:
            results = self._compressed_scores(pieces, disable_tqdm, need_greedy)
        else:
            results = self._full_scores(pieces, disable_tqdm)
        for (strings, *_), res in zip(pieces, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, res)
        return results

    @torch.inference_mode()
    def _full_scores(self, pieces, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Exact log-probabilities with the plain model: left-padded batches, one forward each."""
        results: list[tuple[float, bool] | None] = [None] * len(pieces)
        order = sorted((i for i, p in enumerate(pieces) if p[2]),
                       key=lambda i: -(len(pieces[i][1]) + len(pieces[i][2])))  # similar lengths together
        for i, p in enumerate(pieces):
            if not p[2]:
                results[i] = (0.0, True)
        pad = self.tokenizer.pad_token_id
        for start in tqdm(range(0, len(order), self.batch_size), desc="kvsieve loglikelihood (full)",
                          disable=disable_tqdm):
            rows = order[start:start + self.batch_size]
            inputs = [(pieces[i][1] + pieces[i][2])[:-1] for i in rows]
            width = max(len(x) for x in inputs)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, x in enumerate(inputs):
                ids[r, width - len(x):] = torch.tensor(x)
                mask[r, width - len(x):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            keep = max(len(pieces[i][2]) for i in rows)
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                position_ids=positions.to(self.device), logits_to_keep=keep).logits
            for r, i in enumerate(rows):
                cont = torch.tensor(pieces[i][2], device=logits.device)
                logp = logits[r, logits.shape[1] - len(cont):].float().log_softmax(-1)
                results[i] = (logp.gather(-1, cont[:, None]).sum().item(), bool((logp.argmax(-1) == cont).all()))
                seen = len(pieces[i][1]) + len(cont) - 1
                self.stats["loglikelihood"].add([self.kv_heads * seen], [self.kv_heads * seen], self.kv_heads, seen,
                                                len(cont), 0, 0)
        return results  # type: ignore[return-value]

    def _compressed_scores(self, pieces, disable_tqdm: bool, need_greedy: bool) -> list[tuple[float, bool]]:
        """Teacher forcing through the compressed cache (kvsieve.eval.perplexity.score_text)."""
        from .perplexity import score_text

        context_nll: dict[tuple[int, ...], float] = {}

        def nll(ids: list[int], record: bool) -> float:
            if len(ids) < 2:
                return 0.0  # a single token predicts nothing
            score = score_text(self.model, _ids_tokenizer, ids, self.policy)
            if record:
                self.stats["loglikelihood"].add(score.peak_kv_tokens, score.final_kv_tokens, self.kv_heads, len(ids),
                                                score.scored_tokens, score.compression_events, score.peak_kv_bytes)
            return score.nll

        logprobs = []
        desc = f"kvsieve loglikelihood ({self.policy.name})"
        for strings, ctx, cont, _ in tqdm(pieces, desc=desc, disable=disable_tqdm):
            if not cont:
                logprobs.append(0.0)
                continue
            key = tuple(ctx)
            if key not in context_nll:
                context_nll[key] = nll(ctx, record=False)
            logprobs.append(context_nll[key] - nll(ctx + cont, record=True))
        greedy = self._greedy_matches(pieces) if need_greedy else [False] * len(pieces)
        return list(zip(logprobs, greedy))

    def _greedy_matches(self, pieces) -> list[bool]:
        """Would greedy decoding under the policy produce each continuation? One generation per context."""
        from ..generate import GenerateConfig, generate

        wanted: dict[tuple[int, ...], int] = {}  # context ids -> longest continuation asked of it
        for _, ctx, cont, _ in pieces:
            if cont and ctx:
                wanted[tuple(ctx)] = max(wanted.get(tuple(ctx), 0), len(cont))
        produced: dict[tuple[int, ...], list[int]] = {}
        items = sorted(wanted.items(), key=lambda kv: -kv[1])
        for start in range(0, len(items), self.batch_size):
            batch = items[start:start + self.batch_size]
            config = GenerateConfig(max_new_tokens=max(n for _, n in batch), prefill_chunk=self.prefill_chunk,
                                    chat_template=False, ignore_eos=True)
            result = generate(self.model, self.tokenizer, [list(ctx) for ctx, _ in batch], self.policy, config)
            produced.update({ctx: ids for (ctx, _), ids in zip(batch, result.token_ids)})
        return [tuple(ctx) in produced and produced[tuple(ctx)][:len(cont)] == list(cont)
                for _, ctx, cont, _ in pieces]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, desc="kvsieve loglikelihood_rolling", disable=disable_tqdm):
            (string,) = req.args[:1]
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string, add_special_tokens=False), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True,
                                                need_greedy=False)
            total = sum(score for score, _ in scores)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out


def main(argv: list[str] | None = None) -> None:
    """The harness's own command line (``run``, ``ls``, ``validate``) with ``kvsieve`` registered."""
    from lm_eval.__main__ import cli_evaluate

    argv = sys.argv[1:] if argv is None else list(argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except ModelArgsError as err:  # one line, as for every other kvsieve command's usage errors
        raise SystemExit(f"error: {err}") from None
    finally:
        sys.argv = saved


if __name__ == "__main__":
    # `python -m kvsieve.eval.lmeval`: register through the importable module, not this __main__ copy
    from kvsieve.eval.lmeval import main as _main

    _main()
