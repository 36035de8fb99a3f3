"""The decode loop: prefill in chunks, then decode step, policy step and sample, then stats.

Token layout of a batch after left padding (P = longest prompt)::

    row 0:  p p p t t t t | g g g ...      p: padding (position DEAD_POS, dropped after prefill)
    row 1:  t t t t t t t | g g g ...      t: prompt token at positions 0, 1, ...
                                           g: generated; position = row's seen_tokens

Positions count each row's real tokens, so they are never the cache length: after eviction
the cache is shorter than the sequence.  The loop reads the device only every
``check_every`` steps (stop conditions, streaming, dropping finished rows) and on the
compression steps of policies whose allocation is data dependent.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .attention import ATTN_IMPLEMENTATION, check_supported
from .cache import DEAD_POS, SieveCache
from .graphs import CapturedStep, forward_step
from .memory import check_fits
from .policy import Policy, compress, drop_dead
from .random_models import RANDOM_NOTE, is_random

Prompt = str | list[dict]  # plain text, or chat messages [{"role": ..., "content": ...}]


@dataclass
class GenerateConfig:
    """Decoding settings.

    ``temperature`` 0 is greedy.  ``check_every`` is how many decode steps pass between host
    reads of the new tokens (stop conditions); rows may decode up to that many tokens past
    their stop, which are discarded.  ``grow_chunk`` is how many slots an unbounded cache
    grows by at a time.
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
    # Replay the decode step from a CUDA graph (CUDA only; implies static_shapes).
    cuda_graph: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if self.prefill_chunk < 1 or self.check_every < 1 or self.grow_chunk < 1:
            raise ValueError("prefill_chunk, check_every and grow_chunk must be >= 1")


@dataclass
class RowStats:
    """Per-prompt statistics. KV token counts are per layer, summed over kv heads; bytes are
    the cache's allocated bytes (K, V and per-token metadata) divided by the rows sharing it."""

    prompt_tokens: int
    generated_tokens: int = 0
    finish_reason: str = "length"  # "eos", "stop" or "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens_per_s: float = 0.0
    final_kv_tokens: list[int] = field(default_factory=list)
    peak_kv_tokens: list[int] = field(default_factory=list)
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

    def as_rows(self) -> list[dict]:
        return [{"text": t, "token_ids": ids, **asdict(s), "settings": self.settings}
                for t, ids, s in zip(self.texts, self.token_ids, self.stats)]


# ---------------------------------------------------------------------------- inputs
def encode_prompts(tokenizer, prompts: Sequence[Prompt], config: GenerateConfig) -> list[list[int]]:
    """Token ids per prompt, through the chat template when the tokenizer has one."""
    use_template = config.chat_template and getattr(tokenizer, "chat_template", None)
    encoded = []
    for prompt in prompts:
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
class _Run:
    """Book-keeping of one generate call: which rows are still active and their stats."""

    def __init__(self, tokenizer, model, encoded, config, on_token, on_finish=None, settings=None):
        self.tokenizer, self.config, self.on_token = tokenizer, config, on_token
        self.on_finish, self.settings = on_finish, settings  # hand_over's callback and the policy settings
        self.stats = [RowStats(prompt_tokens=len(ids)) for ids in encoded]
        self.tokens: list[list[int]] = [[] for _ in encoded]
        self.active = list(range(len(encoded)))  # original row index of each cache row
        self.rows = torch.arange(len(encoded), device=model.device)  # the same, on the device
        self.on_tokens: list[Callable] = []  # attach() callbacks, called before every forward
        eos = {tokenizer.eos_token_id, *_as_list(getattr(model.generation_config, "eos_token_id", None))}
        self.eos_ids = set() if config.ignore_eos else {t for t in eos if t is not None}

    def text(self, row: int) -> str:
        """Row ``row``'s generated text: without a final EOS token, cut at the first stop string."""
        seq = self.tokens[row]
        if self.stats[row].finish_reason == "eos":
            seq = seq[:-1]
        return _cut_at_stop(self.tokenizer.decode(seq, skip_special_tokens=True), self.config.stop_strings)

    def hand_over(self, rows: list[int]) -> None:
        """Give each finished row (an original row index) to ``on_finish`` with its text and stats."""
        if self.on_finish is not None:
            for row in rows:
                self.on_finish(row, self.text(row), self.stats[row], self.settings)

    def take(self, new_tokens: list[list[int]]) -> list[int]:
        """Append host copies of new tokens; return cache rows that finished."""
        finished = []
        for cache_row, (row, new) in enumerate(zip(self.active, new_tokens)):
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

    def _hit_stop(self, seq: list[int]) -> bool:
        tail = self.tokenizer.decode(seq[-32:])
        return any(s in tail for s in self.config.stop_strings)


def _attach(stack: contextlib.ExitStack, model, tokenizer, *hooks) -> list[Callable]:
    """Enter each hook's ``attach(model, tokenizer)`` for this call; return the callbacks yielded."""
    callbacks = [stack.enter_context(h.attach(model, tokenizer)) for h in hooks if h is not None]
    return [cb for cb in callbacks if cb is not None]


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _forward(model, cache: SieveCache, input_ids, query_pos, observer, on_tokens=(), rows=None):
    for hook in on_tokens:
        hook(input_ids, query_pos, rows)
    return forward_step(model, cache, input_ids, query_pos, observer)


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    policy: Policy | None = None,
    config: GenerateConfig | None = None,
    on_token: Callable[[int, list[int]], None] | None = None,
    steering=None,
    on_finish: "FinishCallback | None" = None,
) -> GenerationResult:
    """Generate for a batch of prompts with a compressed KV cache.

    ``policy`` defaults to no eviction.  ``on_token(row, new_token_ids)`` streams tokens as
    they are read back (every ``check_every`` steps, every step when a callback is given).
    ``on_finish(row, text, stats, settings)`` is called once per row as soon as the row ends
    (EOS, a stop string or the token limit), with its final text and statistics, so a caller
    can store it before the rest of the batch is done.
    ``steering`` (optional, ``kvsieve.steering.Steering``) adds SkipKV's adaptive steering vector;
    ``None`` leaves the model untouched.
    """
    policy = policy or Policy(scorer=None)
    config = config or GenerateConfig()
    if on_token is not None:
        config = GenerateConfig(**{**asdict(config), "check_every": 1})
    check_supported(model)
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt")
    device = model.device
    encoded = encode_prompts(tokenizer, prompts, config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids, positions = left_pad(encoded, pad_id or 0, device)
    policy = policy.for_horizon(input_ids.shape[1] + config.max_new_tokens)  # LagKV at a budget
    if config.kv_memory_gb is not None:
        check_fits(model, policy, len(encoded), input_ids.shape[1], config.max_new_tokens, config.kv_memory_gb)
    settings = policy.settings()
    if steering is not None:
        settings["steering"] = steering.settings()
    if is_random(model):
        settings["weights"] = RANDOM_NOTE
    run = _Run(tokenizer, model, encoded, config, on_token, on_finish, settings)
    num_layers = model.config.num_hidden_layers
    budgets = policy.layer_budgets(num_layers)
    scorer = policy.scorer
    cache = SieveCache.for_scorer(num_layers, scorer, grow_chunk=config.grow_chunk)
    static = config.static_shapes or config.cuda_graph
    for layer, budget in zip(cache.layers, budgets):
        layer.static = static
        layer.query_window = scorer.query_window() if scorer else 0
        # never allocate past what the run can need: budget + interval, or the whole sequence
        longest = input_ids.shape[1] + config.max_new_tokens
        layer.capacity_hint = longest if budget is None else min(longest, budget + policy.interval)
    observer = policy.observer()
    generator = torch.Generator(device=device).manual_seed(config.seed) if config.temperature > 0 else None

    previous_attn = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    hooks = contextlib.ExitStack()
    try:
        run.on_tokens = _attach(hooks, model, tokenizer, scorer, steering)
        if config.cuda_graph and run.on_tokens:
            raise ValueError("cuda_graph cannot replay per-token host hooks (SkipKV sentences, steering, "
                             "trace recording); drop cuda_graph for this method")
        t0 = time.perf_counter()
        cache.seen_tokens = torch.zeros(len(encoded), dtype=torch.long, device=device)
        for start in range(0, input_ids.shape[1], config.prefill_chunk):
            chunk = slice(start, start + config.prefill_chunk)
            logits = _forward(model, cache, input_ids[:, chunk], positions[:, chunk], observer, run.on_tokens, run.rows)
            if scorer is not None and policy.prefill_block:  # block-wise prefill eviction
                cache.seen_tokens = (positions[:, : chunk.stop] != DEAD_POS).sum(dim=1)
                compress(cache, policy, budgets)
        cache.seen_tokens = torch.tensor([len(ids) for ids in encoded], device=device)
        drop_dead(cache, headroom=policy.interval if scorer else config.grow_chunk,
                  past_hint=scorer is not None and not policy.compress_prefill)
        tracker = _Tracker(run, cache)
        if scorer is not None and policy.compress_prefill:
            tracker.record()
            if compress(cache, policy, budgets):
                tracker.event()
        if static:  # room for every append until the next compression (or the end, for full)
            for layer in cache.layers:
                layer.reserve(max(layer.capacity_hint, layer.max_len + (policy.interval if scorer else 0)))
            tracker.bytes()
        next_token = sample(logits, config, generator)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        for stat in run.stats:
            stat.prefill_s = prefill_s
        _decode(model, cache, policy, budgets, config, run, tracker, next_token, observer, generator)
    finally:
        hooks.close()
        model.set_attn_implementation(previous_attn)

    texts = [run.text(row) for row in range(len(encoded))]
    return GenerationResult(texts=texts, token_ids=run.tokens, stats=run.stats, settings=settings,
                            kv_bytes_trace=tracker.trace)


class _Tracker:
    """Peak live tokens and allocated bytes, read at the moments they can peak."""

    def __init__(self, run: _Run, cache: SieveCache):
        self.run, self.cache = run, cache
        n_layers = len(cache.layers)
        self.peak_tokens = torch.zeros(len(run.stats), n_layers, dtype=torch.long, device=cache.seen_tokens.device)
        self.bytes_seen = 0
        self.step = 0  # decode steps done, set by the loop
        self.trace: list[tuple[int, int]] = []

    def rows(self) -> torch.Tensor:
        return torch.tensor(self.run.active, device=self.peak_tokens.device)

    def record(self) -> None:
        """Before a compaction (and at a row's end) live lengths are at a local maximum."""
        rows = self.rows()
        self.peak_tokens[rows] = torch.maximum(self.peak_tokens[rows], self.cache.live_tokens())
        self.bytes()

    def bytes(self) -> None:
        total = self.cache.allocated_bytes()
        if total != self.bytes_seen:
            self.bytes_seen = total
            self.trace.append((self.step, total))
            share = total // len(self.run.active)
            for row in self.run.active:
                self.run.stats[row].peak_kv_bytes = max(self.run.stats[row].peak_kv_bytes, share)

    def event(self) -> None:
        for row in self.run.active:
            self.run.stats[row].compression_events += 1
        self.bytes()

    def finish(self, cache_rows: list[int], decode_start: float) -> None:
        self.record()
        live = self.cache.live_tokens()[cache_rows].tolist()
        peaks = self.peak_tokens[[self.run.active[r] for r in cache_rows]].tolist()
        now = time.perf_counter()
        for cache_row, final, peak in zip(cache_rows, live, peaks):
            stat = self.run.stats[self.run.active[cache_row]]
            stat.final_kv_tokens, stat.peak_kv_tokens = final, peak
            stat.generated_tokens = len(self.run.tokens[self.run.active[cache_row]])
            stat.decode_s = now - decode_start
            stat.tokens_per_s = stat.generated_tokens / stat.decode_s if stat.decode_s > 0 else 0.0


def _decode(model, cache, policy, budgets, config, run, tracker, next_token, observer, generator):
    device = next_token.device
    out_tokens = torch.empty(len(run.active), config.max_new_tokens, dtype=torch.long, device=device)
    checked = 0
    decode_start = time.perf_counter()
    bar = _progress(config)
    captured = CapturedStep(model, cache, observer) if config.cuda_graph else None
    for step in range(config.max_new_tokens):
        out_tokens[:, step] = next_token
        last = step == config.max_new_tokens - 1
        if last or (step + 1 - checked) >= config.check_every:
            finished = run.take(out_tokens[:, checked: step + 1].tolist())
            checked = step + 1
            if finished:
                _sync(device)
                tracker.finish(finished, decode_start)
                run.hand_over([run.active[r] for r in finished])
                keep = [r for r in range(len(run.active)) if r not in set(finished)]
                run.active = [run.active[r] for r in keep]
                if not run.active:
                    break
                keep_t = torch.tensor(keep, device=device)
                if policy.scorer is not None:
                    policy.scorer.before_select_rows(keep_t)
                cache.select_rows(keep_t)
                run.rows = run.rows[keep_t]
                out_tokens, next_token = out_tokens[keep_t], next_token[keep_t]
        if last:
            break
        query_pos = cache.seen_tokens[:, None]
        if captured is not None:
            logits = captured(next_token[:, None], query_pos)
        else:
            step_observer = observer if policy.observes_step(step) else None
            logits = _forward(model, cache, next_token[:, None], query_pos, step_observer, run.on_tokens, run.rows)
        cache.seen_tokens = cache.seen_tokens + 1
        tracker.step = step + 1
        tracker.bytes()
        if policy.scorer is not None and (step + 1) % policy.interval == 0:
            if policy.needs_compression(cache, budgets):
                tracker.record()
                compress(cache, policy, budgets)
                tracker.event()
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


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]
