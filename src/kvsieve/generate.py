"""``generate``: encode and pad the prompts, then prefill, decode, sample and stop, top to bottom.

Prompts are texts, chat message lists or token ids (``list[int]``, used as given).  Hooks
(``hooks.Hook``, e.g. SkipKV's steering) run beside the policy for one call.

Token layout of a batch after left padding (P = longest prompt)::

    row 0:  p p p t t t t | g g g ...      p: padding (position DEAD_POS, dropped after prefill)
    row 1:  t t t t t t t | g g g ...      t: prompt token at positions 0, 1, ...
                                           g: generated; position = row's seen_tokens

Positions count each row's real tokens, so they are never the cache length: after eviction
the cache is shorter than the sequence.  The model is driven by a ``DecodeSession``
(``kvsieve.session``), which owns the cache and its steps; this loop reads the device only
every ``check_every`` steps (stop conditions, streaming, finished rows) and on the compression
steps of policies whose allocation is data dependent.
"""

from __future__ import annotations

import numbers
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .attention import check_supported
from .cache import DEAD_POS
from .checks import InputError, SettingError, check_at_least, check_fields, shown
from .memory import check_fits
from .hooks import Hook
from .policy import Policy
from .schedule import fitted
from .random_models import RANDOM_NOTE, is_random
from .session import DecodeSession, _sync

Prompt = str | list[dict] | list[int]  # plain text, chat messages [{"role": ..., "content": ...}], or token ids


@dataclass
class GenerateConfig:
    """Decoding settings.

    ``temperature`` 0 is greedy.  ``check_every`` is how many decode steps pass between host
    reads of the new tokens (stop conditions, streaming); rows may decode up to that many
    tokens past their stop, which are discarded.  ``grow_chunk`` is how many slots an
    unbounded cache grows by at a time.  ``compile`` runs the decode step through
    ``torch.compile`` (see ``kvsieve.session``); its compile time is reported apart from
    decode time (``RowStats.compile_s``).  ``prefill_chunk`` is how many prompt tokens one
    prefill forward pass reads; 512 is kvsieve's choice (no paper sets it; it has been the
    default since the engine's first version, with no reason recorded): it bounds one pass's
    activations and the attention rows an observing scorer reads ([B, H_kv, G, T, cap], T <= 512),
    and a prompt of up to 512 tokens is read in one pass.  Block-wise prefill eviction reads the
    policy's blocks instead (``Policy.prefill_block``; CAOTE: 128).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    prefill_chunk: int = 512
    check_every: int = 8
    chat_template: bool = True
    system_prompt: str | None = None
    grow_chunk: int = 256
    progress: bool = False
    ignore_eos: bool = False  # benchmarks: always decode max_new_tokens
    kv_memory_gb: float | None = None  # refuse batches whose planned KV peak exceeds this
    # Preallocate every layer at its final capacity (prompt + max_new_tokens for full, budget +
    # interval when bounded) and keep tensors at fixed addresses: same shapes every decode step.
    static_shapes: bool = False
    # Compile the fixed-capacity decode step (implies static_shapes): Inductor on CPU, CUDA
    # graphs on CUDA. Policies with per-token host hooks say so once and decode eagerly.
    compile: bool = False

    def __post_init__(self):
        check_fields(self)
        for name, least in (("max_new_tokens", 1), ("temperature", 0), ("top_k", 0), ("prefill_chunk", 1),
                            ("check_every", 1), ("grow_chunk", 1)):
            check_at_least(name, getattr(self, name), least)
        if not 0 < self.top_p <= 1:
            raise SettingError("top_p", f"{{name}} must be in (0, 1], got {self.top_p!r}")
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise SettingError("kv_memory_gb", f"{{name}} is the KV cache memory a batch may plan, in GiB: it must "
                                               f"be > 0, got {self.kv_memory_gb!r}")


@dataclass
class RowStats:
    """Per-prompt statistics. KV token counts are per layer, summed over kv heads; bytes are
    the cache's allocated bytes (K, V and per-token metadata) divided by the rows sharing it.
    ``peak_kv_tokens`` includes the prefill transient (a prompt held whole until its first
    compression); ``steady_peak_kv_tokens`` counts only after the first compression (zeros if none):
    the peaks a budget bounds."""

    prompt_tokens: int
    generated_tokens: int = 0
    finish_reason: str = "length"  # "eos", "stop" or "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0  # decoding only: compile time excluded
    compile_s: float = 0.0  # steps that compiled a graph (GenerateConfig.compile), shared by the batch
    compiled_steps: int = 0  # decode steps of the batch that ran compiled (0: eager throughout)
    tokens_per_s: float = 0.0
    final_kv_tokens: list[int] = field(default_factory=list)
    peak_kv_tokens: list[int] = field(default_factory=list)
    steady_peak_kv_tokens: list[int] = field(default_factory=list)
    peak_kv_bytes: int = 0
    compression_events: int = 0


# on_finish(row, text, stats, settings): one row's final text and statistics, as it ends
FinishCallback = Callable[[int, str, RowStats, dict], None]


@dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]
    stats: list[RowStats]
    settings: dict
    # (decode step, allocated KV bytes of the whole batch) each time the allocation changed
    kv_bytes_trace: list[tuple[int, int]] = field(default_factory=list)
    # (decode step, live KV tokens per (row, layer, kv head) on average) at every host check
    live_kv_trace: list[tuple[int, float]] = field(default_factory=list)
    # (time.perf_counter() when it ended, seconds) for each decode step that compiled a graph
    compile_spans: list[tuple[float, float]] = field(default_factory=list)

    def as_rows(self) -> list[dict]:
        return [{"text": t, "token_ids": ids, **asdict(s), "settings": self.settings}
                for t, ids, s in zip(self.texts, self.token_ids, self.stats)]


# ---------------------------------------------------------------------------- inputs
def prompt_list(prompts) -> list[Prompt]:
    """``prompts`` as a list of prompts: a bare string or one list of token ids is one prompt; an
    item that is neither text, a list of chat messages nor a list of token ids is refused by its
    index (a ValueError)."""
    if isinstance(prompts, torch.Tensor):
        raise ValueError(f"prompts must be lists of token ids, not a tensor {tuple(prompts.shape)}: pass "
                         "ids.tolist(), one list per prompt without its padding")
    if isinstance(prompts, str) or (_is_ids(prompts) and len(prompts) > 0):
        return [prompts]
    prompts = list(prompts)
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) and not _is_ids(prompt) and not _is_chat(prompt):
            hint = ("; to pass one conversation, wrap it in a list: [messages]" if isinstance(prompt, dict) else
                    "; pass ids.tolist(), without padding" if isinstance(prompt, torch.Tensor) else "")
            raise ValueError(f"prompts[{index}] must be text, a list of chat messages ({{'role': ..., "
                             f"'content': ...}}) or a list of token ids (ints), got {shown(prompt)}{hint}")
    return prompts


def _is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in prompt)


def _is_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)


def hook_list(hooks) -> list[Hook]:
    """``hooks`` as a list, each with ``name``, ``attach(model, tokenizer)`` and ``settings()``
    (``hooks.Hook``), their names distinct (each names its entry of the settings record)."""
    if isinstance(hooks, Hook):
        raise ValueError(f"hooks= takes a list of hooks: hooks=[{type(hooks).__name__}(...)]")
    hooks = list(hooks)
    for index, hook in enumerate(hooks):
        if not isinstance(hook, Hook):
            raise ValueError(f"hooks[{index}] must have name, attach(model, tokenizer) and settings() (a "
                             f"kvsieve.hooks.Hook, e.g. kvsieve.steering.Steering), got {shown(hook)}")
    names = [hook.name for hook in hooks]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"hooks {twice} given more than once: pass one hook of each name")
    return hooks


def context_length(model) -> int | None:
    """The most positions ``model`` was built for (``max_position_embeddings``), or None if it says none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if limit else None


def check_context(model, encoded: list[list[int]], max_new_tokens: int) -> None:
    """Refuse a prompt longer than the model's context (it would be read at positions the model was
    never trained on, and its output is garbage) or holding an id outside the model's vocabulary;
    warn when the new tokens would run past the context."""
    vocab = model.get_input_embeddings().num_embeddings
    for index, ids in enumerate(encoded):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"prompt {index} holds token id {bad}, outside the model's vocabulary 0..{vocab - 1}; "
                             "pass ids from this model's tokenizer")
    limit = context_length(model)
    if limit is None:
        return
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    tokens = len(encoded[longest])
    if tokens > limit:
        raise InputError(f"prompt {longest} has {tokens} tokens, more than the model's context of {limit} "
                         "(max_position_embeddings); shorten it")
    if tokens + max_new_tokens > limit:
        warnings.warn(f"prompt {longest} has {tokens} tokens: with max_new_tokens={max_new_tokens} its generation "
                      f"may run past the model's context of {limit} tokens, where the text degrades", stacklevel=4)


def encode_prompts(tokenizer, prompts: Sequence[Prompt], config: GenerateConfig) -> list[list[int]]:
    """Token ids per prompt, through the chat template when the tokenizer has one; a prompt
    of token ids is taken as given (no template, no special tokens added)."""
    use_template = config.chat_template and getattr(tokenizer, "chat_template", None)
    encoded = []
    for prompt in prompts:
        if _is_ids(prompt):
            encoded.append([int(t) for t in prompt])
            continue
        if isinstance(prompt, str) and not use_template:
            encoded.append(tokenizer(prompt).input_ids)
            continue
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if config.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": config.system_prompt}, *messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        encoded.append(list(ids))
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("empty prompt: every prompt needs at least one token")
    return encoded


def left_pad(encoded: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, P] and per-token positions [B, P] (DEAD_POS on padding)."""
    P = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), P), pad_id, dtype=torch.long)
    positions = torch.full((len(encoded), P), DEAD_POS, dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, P - len(ids):] = torch.tensor(ids)
        positions[row, P - len(ids):] = torch.arange(len(ids))
    return input_ids.to(device), positions.to(device)


# ---------------------------------------------------------------------------- sampling
def sample(logits: torch.Tensor, config: GenerateConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from logits [B, V] without a host sync."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / config.temperature
    if config.top_k > 0:
        kth = logits.topk(min(config.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > config.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (no torch.multinomial sync).
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(dim=-1)


# ---------------------------------------------------------------------------- the loop
class _Rows:
    """Host side of one generate call: each original row's tokens, stop state and statistics."""

    def __init__(self, tokenizer, model, encoded, config, on_token, on_finish=None, settings=None):
        self.tokenizer, self.config, self.on_token = tokenizer, config, on_token
        self.on_finish, self.settings = on_finish, settings  # hand_over's callback and the policy settings
        self.stats = [RowStats(prompt_tokens=len(ids)) for ids in encoded]
        self.tokens: list[list[int]] = [[] for _ in encoded]
        eos = {tokenizer.eos_token_id, *_as_list(getattr(model.generation_config, "eos_token_id", None))}
        self.eos_ids = set() if config.ignore_eos else {t for t in eos if t is not None}

    def text(self, row: int) -> str:
        """Row ``row``'s generated text: without a final EOS token, cut at the first stop string."""
        seq = self.tokens[row]
        if self.stats[row].finish_reason == "eos":
            seq = seq[:-1]
        return _cut_at_stop(self.tokenizer.decode(seq, skip_special_tokens=True), self.config.stop_strings)

    def take(self, slots: list[int | None], new_tokens: list[list[int]]) -> list[int]:
        """Append host copies of new tokens (one list per cache row; ``slots`` maps cache rows
        to original rows, None for a finished filler row); return the cache rows that finished."""
        finished = []
        for cache_row, (row, new) in enumerate(zip(slots, new_tokens)):
            if row is None:
                continue
            stat, seq, start = self.stats[row], self.tokens[row], len(self.tokens[row])
            for tok in new:
                seq.append(tok)
                if tok in self.eos_ids:
                    stat.finish_reason = "eos"
                    break
                if self.config.stop_strings and self._hit_stop(seq):
                    stat.finish_reason = "stop"
                    break
            if self.on_token is not None and len(seq) > start:
                self.on_token(row, seq[start:])
            if stat.finish_reason != "length" or len(seq) >= self.config.max_new_tokens:
                finished.append(cache_row)
        return finished

    def finish(self, session: DecodeSession, cache_rows: list[int], decode_start: float) -> None:
        """Fill in the statistics of the rows in ``cache_rows`` and hand them to ``on_finish``."""
        final, peak, steady = session.row_kv_tokens(cache_rows)
        decode_s = time.perf_counter() - decode_start - session.compile_s
        for cache_row, final_tokens, peak_tokens, steady_tokens in zip(cache_rows, final, peak, steady):
            row = session.slots[cache_row]
            stat = self.stats[row]
            stat.final_kv_tokens, stat.peak_kv_tokens = final_tokens, peak_tokens
            stat.steady_peak_kv_tokens = steady_tokens
            stat.peak_kv_bytes = session.peak_kv_bytes[row]
            stat.compression_events = session.compression_events[row]
            stat.generated_tokens = len(self.tokens[row])
            stat.decode_s, stat.compile_s, stat.compiled_steps = decode_s, session.compile_s, session.compiled_steps
            stat.tokens_per_s = stat.generated_tokens / decode_s if decode_s > 0 else 0.0
            if self.on_finish is not None:
                self.on_finish(row, self.text(row), stat, self.settings)

    def _hit_stop(self, seq: list[int]) -> bool:
        tail = self.tokenizer.decode(seq[-32:])
        return any(s in tail for s in self.config.stop_strings)


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    policy: Policy | None = None,
    config: GenerateConfig | None = None,
    on_token: Callable[[int, list[int]], None] | None = None,
    hooks: Sequence[Hook] = (),
    on_finish: "FinishCallback | None" = None,
) -> GenerationResult:
    """Generate for a batch of prompts with a compressed KV cache.

    ``prompts`` are texts, chat message lists or lists of token ids (a bare string, or one list of
    ids, is one prompt; ids go to the model as given: no chat template, no special tokens); one
    longer than the model's context (``max_position_embeddings``) is refused.
    ``policy`` defaults to no eviction.  ``on_token(row, new_token_ids)`` streams tokens as
    they are read back, every ``config.check_every`` steps (set it to 1 for token-by-token
    streaming; each read is a host sync).  ``on_finish(row, text, stats, settings)`` is called
    once per row as soon as the row ends (EOS, a stop string or the token limit), with its
    final text and statistics, so a caller can store it before the rest of the batch is done.
    ``hooks`` (``hooks.Hook``) run beside the policy for this call, each attached like the
    scorer and recorded as ``settings[hook.name]``: ``hooks=[Steering(vector)]`` adds SkipKV's
    adaptive steering (``settings["steering"]``); none leaves the model untouched.
    """
    policy = Policy(scorer=None) if policy is None else policy
    config = GenerateConfig() if config is None else config
    if not isinstance(policy, Policy):
        raise SettingError("policy", "{name} must be a Policy, e.g. make_policy('tova', budget=128), got "
                                     f"{shown(policy)}")
    if not isinstance(config, GenerateConfig):
        raise SettingError("config", "{name} must be a GenerateConfig, e.g. GenerateConfig(max_new_tokens=64), got "
                                     f"{shown(config)}")
    check_supported(model)
    prompts, hooks = prompt_list(prompts), hook_list(hooks)
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt")
    encoded = encode_prompts(tokenizer, prompts, config)
    check_context(model, encoded, config.max_new_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids, positions = left_pad(encoded, pad_id or 0, model.device)
    horizon = input_ids.shape[1] + config.max_new_tokens
    policy = fitted(policy, horizon, prompt=max(len(ids) for ids in encoded))  # LagKV at a budget
    if config.kv_memory_gb is not None:
        check_fits(model, policy, len(encoded), input_ids.shape[1], config.max_new_tokens, config.kv_memory_gb)
    settings = policy.settings()
    for hook in hooks:
        if hook.name in settings:
            raise ValueError(f"hook {hook.name!r} would overwrite the settings record's {hook.name!r}; rename the hook")
        settings[hook.name] = hook.settings()
    if is_random(model):
        settings["weights"] = RANDOM_NOTE
    rows = _Rows(tokenizer, model, encoded, config, on_token, on_finish, settings)
    session = DecodeSession(model, policy, batch_size=len(encoded), horizon=horizon, static=config.static_shapes,
                            compile=config.compile, grow_chunk=config.grow_chunk)
    generator = torch.Generator(device=model.device).manual_seed(config.seed) if config.temperature > 0 else None
    with session.attached(tokenizer, *hooks):
        t0 = time.perf_counter()
        logits = session.prefill(input_ids, positions, config.prefill_chunk)
        next_token = sample(logits, config, generator)
        _sync(model.device)
        for stat in rows.stats:
            stat.prefill_s = time.perf_counter() - t0
        _decode(session, rows, config, next_token, generator)
    texts = [rows.text(row) for row in range(len(encoded))]
    return GenerationResult(texts=texts, token_ids=rows.tokens, stats=rows.stats, settings=settings,
                            kv_bytes_trace=session.kv_bytes_trace, live_kv_trace=session.live_kv_trace,
                            compile_spans=session.compile_spans)


def _decode(session: DecodeSession, rows: _Rows, config: GenerateConfig, next_token, generator) -> None:
    """Step, compress, sample; every ``check_every`` steps read the new tokens and let finished rows go."""
    out_tokens = torch.empty(len(session.slots), config.max_new_tokens, dtype=torch.long, device=next_token.device)
    checked = 0
    decode_start = time.perf_counter()
    bar = _progress(config)
    for step in range(config.max_new_tokens):
        out_tokens[:, step] = next_token
        last = step == config.max_new_tokens - 1
        if last or step + 1 - checked >= config.check_every:
            session.record_live()  # joins the host read below
            finished = rows.take(session.slots, out_tokens[:, checked: step + 1].tolist())
            checked = step + 1
            if finished:
                _sync(next_token.device)
                rows.finish(session, finished, decode_start)
                keep = session.drop_finished(finished)
                if not session.running_rows():
                    break
                if keep is not None:
                    out_tokens, next_token = out_tokens[keep], next_token[keep]
        if last:
            break
        logits = session.step(next_token)
        next_token = sample(logits, config, generator)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def _progress(config: GenerateConfig):
    if not config.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.max_new_tokens, desc="decode", unit="step", leave=False)


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]
