"""DecodeSession: the one object that runs a batch through the model with a bounded cache.

Every entry point (``generate``, perplexity, the benchmarks, the analyses) drives a model the
same way::

    session = DecodeSession(model, policy, batch_size=B, horizon=P + N, static=..., compile=...)
    logits = session.prefill(input_ids, positions)          # chunked; prompt compression
    for step in range(N):
        logits = session.step(next_token)                  # forward (+ in-place eviction), then the schedule
        ...                                                # every few steps: session.drop_finished(keep)

What is evicted and when is the schedule's (``kvsieve.schedule.Schedule``); the session runs the
forward passes, tells the schedule after each, and keeps the statistics.

``step`` never reads the device: host state (each layer's ``max_len`` bound, capacities) is
advanced on the host, and device state (lengths, positions, per-token scores, ``seen_tokens``)
stays on the device.  That is what lets ``compile=True`` run the fixed-capacity step through
``torch.compile(fullgraph=True)``: Inductor on CPU, CUDA graphs (``mode="reduce-overhead"``) on
CUDA.  Every-step policies that evict in place (``Needs.slot_order_free``: tova, h2o,
streaming, knorm, keydiff, caote on those) evict inside the compiled step; interval
policies compress eagerly every ``interval`` steps, copying back into the same storage.
``random`` draws its scores from a host generator, which cannot be traced: at its default
interval of 1 it says so and decodes eagerly (``Needs.traceable``).

Shapes stay static after warm-up: a layer's capacity is fixed once decoding starts (budget +
interval when bounded; the horizon rounded up to ``CAPACITY_BUCKET`` for ``full``), and finished
rows leave the batch only when at most half of it is still running, down to the next power of
two (the rows kept to fill it are decoded and ignored), so one compiled graph per batch bucket
serves a whole evaluation grid.  A step whose shapes are not the steady ones (a long prompt
kept whole until LazyEviction's first compression, a per-head allocator changing capacity)
runs eagerly.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable

import torch

from .attention import ATTN_IMPLEMENTATION, StepState, cache_kwarg_name, check_supported
from .cache import DEAD_POS, SieveCache
from .hooks import HostHooks
from .policy import Policy
from .schedule import Schedule, store_settings

# Full caches in a compiled session are allocated to a multiple of this many slots, so prompts
# whose length differs by less than the bucket share one compiled graph.
CAPACITY_BUCKET = 64

_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def model_pass(model, cache: SieveCache, tokens: torch.Tensor, query_pos: torch.Tensor | None, observer,
               evict: tuple, schedule: Schedule, cache_kw: str, peak: torch.Tensor | None, logits_to_keep: int = 1):
    """One forward pass, device work only: ``tokens`` [B, T] through the model at ``query_pos``
    [B, T] (DEAD_POS on padding), observing attention when ``observer`` is set and appending K/V
    (the caller has made room, ``cache.prepare``, and counts them after, ``cache.advance``).
    ``query_pos`` None is a decode step: each row's token at its position ``seen_tokens``, then
    ``seen_tokens += 1`` and the schedule's in-place eviction of layers ``evict`` ((layer, budget)
    pairs, ``Schedule.evict_in_pass``), recording live tokens before it into ``peak`` [B, L].
    Returns the last position's logits [B, V] (every position's, [B, T, V], with ``logits_to_keep=0``).
    The function that ``torch.compile`` compiles: it reads no host state that changes between steps."""
    decoding = query_pos is None
    if decoding:
        query_pos = cache.seen_tokens[:, None]
    cache.begin_step(query_pos)
    rope_pos = query_pos.masked_fill(query_pos == DEAD_POS, 0)  # padding: any finite position
    out = model(input_ids=tokens, position_ids=rope_pos, **{cache_kw: cache}, use_cache=True,
                logits_to_keep=logits_to_keep, kvsieve=StepState(cache=cache, query_pos=query_pos, observer=observer))
    logits = out.logits[:, -1] if logits_to_keep == 1 else out.logits
    if not decoding:
        return logits
    cache.count_decoded()
    if evict:
        schedule.evict_in_pass(cache, evict, peak)
    return logits


_COMPILED: dict[tuple[str, str], object] = {}
_BACKEND = ["inductor"]


def compiled_decode_step(device_type: str):
    """``model_pass`` for decode steps, compiled once per process, device type and backend, shared by every
    session so that a grid calling ``generate`` hundreds of times compiles each shape once."""
    key = (device_type, _BACKEND[0])
    if key not in _COMPILED:
        # One compiled function serves every policy and batch bucket: each is a cache entry.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 1024)
        mode = "reduce-overhead" if device_type == "cuda" and key[1] == "inductor" else None  # CUDA graphs
        _COMPILED[key] = torch.compile(model_pass, fullgraph=True, dynamic=False, mode=mode, backend=key[1])
    return _COMPILED[key]


@contextlib.contextmanager
def compile_backend(backend: str):
    """Compile with another ``torch.compile`` backend inside this block: ``"eager"`` traces the
    step with Dynamo (a graph break or a host sync fails exactly as with Inductor, and
    recompiles count the same) but runs it uncompiled, in seconds instead of minutes."""
    previous, _BACKEND[0] = _BACKEND[0], backend
    try:
        yield
    finally:
        _BACKEND[0] = previous


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (for compile-time accounting and tests)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class DecodeSession:
    """One batch, one policy: ``prefill``, ``step``, ``drop_finished``.

    Parameters
    ----------
    model : a supported Hugging Face causal LM (``attention.SUPPORTED_MODEL_TYPES``).
    policy : the eviction policy (``Policy(scorer=None)`` is ``full``).
    batch_size, horizon : rows in the batch and the most tokens (prompt + new) any row holds.
    static : allocate every layer at its decode capacity once and keep tensors at fixed addresses.
    compile : run ``step`` through ``torch.compile`` (implies ``static``); policies with per-token
        host hooks (SkipKV's sentences, steering, trace recording) or untraceable in-step scores
        (random's, ``Needs.traceable``) say so once and run eagerly.
    hooks : objects with ``attach(model, tokenizer)`` (a scorer, a steering vector) entered for
        the session's life by ``attached(tokenizer)``.
    store : the KV store's class, built as ``store(num_layers, grow_chunk=, static=, managed=True,
        **schedule.store_settings(...))``: ``SieveCache``, or another ``engine.Store`` that the
        attention function can read (``tests/test_engine.py``'s dense store).
    """

    def __init__(self, model, policy: Policy, *, batch_size: int, horizon: int, static: bool = False,
                 compile: bool = False, grow_chunk: int = 256, store: type = SieveCache):
        check_supported(model)
        self.model, self.policy = model, policy
        self.scorer = policy.scorer
        self.compile = compile
        self.static = static or compile
        self.num_layers = model.config.num_hidden_layers
        if self.static and self.scorer is None:
            horizon = -(-horizon // CAPACITY_BUCKET) * CAPACITY_BUCKET
        self.horizon = horizon
        self.grow_chunk = grow_chunk
        self.cache = store(self.num_layers, grow_chunk=grow_chunk, static=self.static, managed=True,
                           **store_settings(policy, self.num_layers, horizon))
        # what is evicted and when: the schedule, told after every forward pass
        self.schedule = Schedule(policy, self.cache, horizon, on_compress=self._record_peak)
        self.cache_kw = cache_kwarg_name(model)
        self.device = model.device
        # cache row -> original batch row, or None for a finished row kept to fill a batch bucket
        self.slots: list[int | None] = list(range(batch_size))
        self.rows = torch.arange(batch_size, device=self.device)  # the same, on the device (fillers: their old row)
        self.on_tokens: list = []  # per-token host hooks, called before every forward
        self.on_rows_leave: list = []  # host hooks called before finished rows leave the cache
        self.compile_spans: list[tuple[float, float]] = []  # (perf_counter when it ended, seconds) per step that compiled
        self.compiled_steps = 0  # steps that ran the compiled function
        self.compression_events = [0] * batch_size  # per original row
        self.peak_tokens = torch.zeros(batch_size, self.num_layers, dtype=torch.long, device=self.device)
        # the same after the first compression event: the steady state, without the prefill transient
        self.steady_peak_tokens = torch.zeros_like(self.peak_tokens)
        self._step_peak: torch.Tensor | None = None  # [B_cache, L] live tokens before in-step evictions
        self.kv_bytes_trace: list[tuple[int, int]] = []  # (decode step, allocated bytes) at each change
        self.live_kv_trace: list[tuple[int, float]] = []  # (decode step, mean live tokens per row, layer, head)
        self.peak_kv_bytes = [0] * batch_size
        self._compiled = compiled_decode_step(self.device.type) if compile else None
        if compile and self.schedule.evicts_in_step and not self.scorer.needs.traceable:
            _warn_once(f"{policy.name}: its scores cannot be traced into a compiled step (a host random "
                       "generator); this session decodes eagerly")
            self._compiled = None

    # ------------------------------------------------------------------ set-up
    @contextlib.contextmanager
    def attached(self, tokenizer, *hooks):
        """For the session's life: the kvsieve attention implementation, and each hook's
        ``attach(model, tokenizer)`` (the scorer's and, e.g., a steering vector's)."""
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        try:
            with contextlib.ExitStack() as stack:
                for hook in (self.scorer, *hooks):
                    if hook is not None:
                        self._add_hooks(stack.enter_context(hook.attach(self.model, tokenizer)))
                if self.on_tokens:  # host hooks watch every step and compression: the eager path
                    self.schedule.evict_between_steps()  # evictions go through compress_layer, where hooks see them
                    if self.compile:
                        _warn_once(f"{self.policy.name}: per-token host hooks (SkipKV sentence tracking, steering "
                                   "or trace recording) cannot run inside a compiled step; this session decodes eagerly")
                        self._compiled = None
                yield self
        finally:
            self.on_tokens.clear()
            self.on_rows_leave.clear()
            self.model.set_attn_implementation(previous)

    def _add_hooks(self, hooks: HostHooks | Callable | None) -> None:
        """Take the host callbacks an ``attach`` yielded (a bare callable is ``on_tokens``)."""
        hooks = HostHooks.of(hooks)
        if hooks.on_tokens is not None:
            self.on_tokens.append(hooks.on_tokens)
        if hooks.on_rows_leave is not None:
            self.on_rows_leave.append(hooks.on_rows_leave)

    # ------------------------------------------------------------------ forward passes
    def _pass(self, tokens: torch.Tensor, query_pos: torch.Tensor | None, observer, logits_to_keep: int = 1,
              evict: tuple = ()) -> torch.Tensor:
        """Every forward pass, prefill chunk or decode step (``query_pos`` None): the per-token
        host hooks, room for the tokens, ``model_pass`` (compiled for a decode step at steady
        shapes), and the host-side count of what was appended."""
        cache, T = self.cache, tokens.shape[1]
        for hook in self.on_tokens:
            hook(tokens, cache.seen_tokens[:, None] if query_pos is None else query_pos, self.rows)
        grew = cache.prepare(T)
        args = (self.model, cache, tokens, query_pos, observer, evict, self.schedule, self.cache_kw, self._step_peak,
                logits_to_keep)
        if query_pos is None and self._compiled is not None and self._steady():
            graphs, t0 = compiled_graphs(), time.perf_counter()
            logits = self._compiled(*args)
            self.compiled_steps += 1
            if compiled_graphs() != graphs:
                _sync(self.device)
                ended = time.perf_counter()
                self.compile_spans.append((ended, ended - t0))
        else:
            logits = model_pass(*args)
        cache.advance(T)
        if grew or query_pos is not None:  # a prefill chunk may have allocated (the first one always does)
            self._note_bytes()
        return logits

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, chunk: int = 512,
                all_logits: bool = False) -> torch.Tensor:
        """Prompt tokens [B, P] at ``positions`` [B, P] (DEAD_POS on left padding), in chunks of
        ``chunk`` (in the policy's blocks for block-wise prefill eviction, compressing after each,
        ``Policy.prefill_block``), and compresses after the prompt when the policy compresses it.
        Returns the last position's logits [B, V] (every position's, [B, P, V], with ``all_logits``)."""
        schedule = self.schedule
        chunk = schedule.block or chunk  # the block m of block-wise eviction
        self.cache.set_seen(torch.zeros(input_ids.shape[0], dtype=torch.long, device=self.device))
        pieces = []
        for start in range(0, input_ids.shape[1], chunk):
            part = slice(start, start + chunk)
            logits = self._pass(input_ids[:, part], positions[:, part], schedule.observer, 0 if all_logits else 1)
            pieces.append(logits)
            schedule.after_block(positions[:, : part.stop])  # block-wise prefill eviction, when on
        # static: room for every append until the next compression (or the end, for full)
        if schedule.end_prompt((positions != DEAD_POS).sum(dim=1), self.grow_chunk, static=self.static):
            self._count_event()
        self._note_bytes()
        self._pin_for_cuda_graphs()
        return torch.cat(pieces, dim=1) if all_logits else logits

    def _pin_for_cuda_graphs(self) -> None:
        """On CUDA, tell the compiler the cache tensors the step writes in place keep their
        addresses (as transformers' StaticCache does), so a CUDA graph may replay those writes."""
        if self._compiled is None or self.device.type != "cuda":
            return
        tensors = [self.cache.seen_tokens]
        if self.cache.prompt_len is not None:
            tensors.append(self.cache.prompt_len)
        for layer in self.cache.layers:
            tensors += [layer.keys, layer.values, layer.lengths, *layer.meta.values(), *layer.sums.values()]
            if layer.recent_queries is not None:
                tensors += [layer.recent_queries, layer.recent_query_pos]
        if self._step_peak is not None:  # in-step evictions write it: unmarked, inductor skips CUDA graphs
            tensors.append(self._step_peak)
        for t in tensors:
            torch._dynamo.mark_static_address(t)

    def _steady(self) -> bool:
        """True when every layer is at its decode capacity with room for one more token: the
        shapes a compiled step was built for."""
        return all(layer.capacity == layer.capacity_hint and layer.max_len < layer.capacity
                   for layer in self.cache.layers)

    @property
    def steps(self) -> int:
        """Decode steps done (the schedule counts them)."""
        return self.schedule.steps

    @property
    def compile_s(self) -> float:
        """Seconds spent in steps that compiled a graph."""
        return sum(seconds for _, seconds in self.compile_spans)

    def step(self, tokens: torch.Tensor, compress: bool = True) -> torch.Tensor:
        """One decode step for every cache row: ``tokens`` [B] in, next-token logits [B, V] out.
        The schedule's plan says whether the pass observes attention and which layers drop one
        token inside it; after the pass the schedule compresses what is due (``compress`` False:
        only the in-pass eviction, for benchmarks that time a compression apart)."""
        plan = self.schedule.plan_step()
        if plan.evict and (self._step_peak is None or self._step_peak.shape[0] != len(self.slots)):
            self._step_peak = torch.zeros(len(self.slots), self.num_layers, dtype=torch.long, device=self.device)
            self._pin_for_cuda_graphs()
        logits = self._pass(tokens[:, None], None, plan.observer, evict=plan.evict)
        if plan.evict:
            self._count_event()
        if self.schedule.after_step(plan, compress):
            self._count_event()
            self._note_bytes()
        return logits

    # ------------------------------------------------------------------ rows
    def drop_finished(self, finished: list[int]) -> torch.Tensor | None:
        """Cache rows ``finished`` are done.  Eager sessions drop them now (their memory is
        returned); compiled ones keep them as fillers until at most half the batch runs, then
        shrink to the next power of two, so each batch bucket compiles once.  Returns the cache
        rows kept (a device tensor), or None when the batch is unchanged."""
        self._record_peak()
        for r in finished:
            self.slots[r] = None
        running = self.running_rows()
        size = len(self.slots)
        if not running:
            return None
        if self.compile:
            if len(running) > size // 2:
                return None
            size = _next_pow2(len(running))
        else:
            size = len(running)
        fillers = [r for r, slot in enumerate(self.slots) if slot is None][: size - len(running)]
        keep = sorted(running + fillers)
        keep_t = torch.tensor(keep, device=self.device)  # once per shrink, not per step
        for leave in self.on_rows_leave:
            leave(keep_t)
        self.cache.select_rows(keep_t)
        self.rows = self.rows[keep_t]
        self.slots = [self.slots[r] for r in keep]
        self._step_peak = None  # folded into peak_tokens above
        self._note_bytes()
        self._pin_for_cuda_graphs()
        return keep_t

    def running_rows(self) -> list[int]:
        """Cache rows still decoding a real row (fillers excluded)."""
        return [r for r, slot in enumerate(self.slots) if slot is not None]

    # ------------------------------------------------------------------ statistics
    def _record_peak(self) -> None:
        """Fold the live tokens now (a local maximum: before a compaction, or at a row's end)
        and those before in-step evictions into each original row's peak."""
        live = self.cache.live_tokens()
        if self._step_peak is not None:
            live = torch.maximum(live, self._step_peak)
        self.peak_tokens[self.rows] = torch.maximum(self.peak_tokens[self.rows], live)
        if any(self.compression_events):  # every running row compresses at each event: all of them have
            self.steady_peak_tokens[self.rows] = torch.maximum(self.steady_peak_tokens[self.rows], live)

    def _count_event(self) -> None:
        for slot in self.slots:
            if slot is not None:
                self.compression_events[slot] += 1

    def _note_bytes(self) -> None:
        total = self.cache.allocated_bytes()
        if self.kv_bytes_trace and self.kv_bytes_trace[-1][1] == total:
            return
        self.kv_bytes_trace.append((self.steps, total))
        share = total // len(self.slots)
        for slot in self.slots:
            if slot is not None:
                self.peak_kv_bytes[slot] = max(self.peak_kv_bytes[slot], share)

    def record_live(self) -> None:
        """Note the mean live tokens per (running row, layer, kv head) now: a host read, so the
        decode loop calls it only where it reads the device anyway (every ``check_every`` steps)."""
        running = self.running_rows()
        if running:
            live = self.cache.live_tokens()[running].float().mean() / self.model.config.num_key_value_heads
            self.live_kv_trace.append((self.steps, float(live)))

    def row_kv_tokens(self, cache_rows: list[int]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """(final, peak, steady peak) live tokens per layer for ``cache_rows`` (one host read).  The
        steady peak is the peak after the batch's first compression (zeros when it never compressed):
        the peak the budget bounds, without the prefill transient."""
        self._record_peak()
        index = torch.tensor(cache_rows, device=self.device)
        rows = self.rows[index]
        final, peak, steady = torch.stack([self.cache.live_tokens()[index], self.peak_tokens[rows],
                                           self.steady_peak_tokens[rows]]).tolist()
        return final, peak, steady


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
