"""kvsieve's vLLM scheduler: decides when a request is compressed and to how many tokens, cuts
its block list to the kept blocks, and gives the freed tail blocks back to vLLM's block pool once
the step that compacted them has run.  Selected with ``scheduler_cls``
(``kvsieve.vllm.engine_kwargs``); read against vLLM 0.32 (``v1/core/sched/scheduler.py``).

Per step (docs/vllm-design.md, "The scheduler"):

1. before vLLM's ``schedule()``: every running request whose prompt is in and whose compression
   is due (``plan.keep_count``) gets its block list cut to ``ceil((keep + 1) / block_size)``
   blocks (its kept tokens and this step's new one, which may land in a block that held old
   tokens: the worker reads them out before the forward pass writes it); the cut blocks are
   held, not freed, since the worker still reads them; its offset becomes ``logical - keep``;
2. vLLM's ``schedule()`` runs; ``allocate_slots`` sees each request's KV length, not its logical
   length (``SieveKVCacheManager``), so a compressed request asks for blocks only for what it holds;
3. after it: a compressed request that was scheduled gets a ``Compaction`` in this step's plan; one
   that was not is put back as it was; one that vLLM preempted meanwhile has its held blocks freed;
4. ``update_from_output`` (the step has run, its compaction done): held blocks go back to the pool,
   before vLLM's stats are made, so ``vllm:kv_cache_usage_perc`` sees them free.

A request may carry its own budget, interval, sinks and recent window (``kvsieve_*`` keys of its
``SamplingParams.extra_args``, ``plan.request_overrides``).  ``add_request`` builds its settings once
(``SieveSettings.for_request``); the scheduler counts with them, and each ``Compaction`` carries the
overrides, so the worker scores with the same policy.  Settings that do not fit the server are
refused there, before the request is ever scheduled: it finishes with an error status and one
logged line, and its output goes out with the next step's.

No request can end the engine: a request whose compaction cannot be planned (step 1) or that the
worker could not compress (``SieveRunnerOutput.kvsieve_failed``, step 4) is finished the same way,
alone, and every other request runs on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

from . import check_vllm
from .bounds import held_tokens
from .paged import blocks_for
from .prefix import shared_tokens, uncacheable
from .plan import (Compaction, SievePlan, SieveSettings, count_of, keep_count, request_settings, settings_of,
                   unsplit)

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, whose handler prints INFO; ours alone has none


def refuse_unsupported(vllm_config, kv_cache_config, settings: SieveSettings) -> None:
    """One clear line for every vLLM feature kvsieve's classes cannot serve with ``settings``."""
    why = []
    cached = uncacheable(settings.policy, settings.method) if vllm_config.cache_config.enable_prefix_caching else None
    if cached:
        why.append(f"prefix caching on: {cached}")
    if vllm_config.speculative_config is not None:
        why.append("speculative decoding")
    if vllm_config.kv_transfer_config is not None:
        why.append("a KV connector (kv_transfer_config)")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        why.append("pipeline parallelism")
    tp = vllm_config.parallel_config.tensor_parallel_size
    split = unsplit(settings.policy) if tp > 1 else None
    if split:
        why.append(f"--tensor-parallel-size {tp} and method {settings.method}: {split}")
    if vllm_config.scheduler_config.async_scheduling:
        why.append("async scheduling (--no-async-scheduling)")
    if len(kv_cache_config.kv_cache_groups) != 1:
        why.append(f"{len(kv_cache_config.kv_cache_groups)} KV cache groups (hybrid or sliding-window models)")
    if vllm_config.model_config.is_encoder_decoder:
        why.append("encoder-decoder models")
    if why:
        raise ValueError("kvsieve cannot serve with " + "; ".join(why))


def effective_settings(settings: SieveSettings, block_size: int) -> str:
    """One line of what the server runs: the method and what its defaults became (budget, sinks,
    recent window, when it compacts, what the budget holds), logged once at start-up."""
    if not settings.compresses:
        return "method full: nothing is evicted"
    policy = settings.policy
    when = (f"every {settings.interval} decode steps over the count" if settings.interval is not None else
            f"when a request's next token needs a new block of {block_size}, at least {policy.interval} tokens "
            "over the count")
    holds = "the prompt outside the budget" if policy.protect_prompt else \
        "the prompt inside the budget, pinned" if policy.pin_prompt else "prompt and output tokens alike"
    count = f"budget {policy.budget}" if policy.scorer.needs.uses_budget else "its own count rule (no budget)"
    return (f"method {settings.method}, {count}, sinks {policy.sinks}, recent {policy.recent}; compacts {when}"
            f"{', and the prompt at once' if policy.compress_prefill else ''}; the budget holds {holds}; "
            f"options {settings.options or 'none'}")


class _KVView:
    """A running request as the KV cache manager should see it: its KV length, not its logical
    length (``num_computed_tokens`` and ``num_tokens`` less the offset); everything else is the request's."""

    __slots__ = ("_request", "_offset")

    def __init__(self, request, offset: int):
        self._request, self._offset = request, offset

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens - self._offset

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens - self._offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class SieveKVCacheManager(KVCacheManager):
    """vLLM's KV cache manager, allocating a compressed request's slots from its KV length, and able
    to cut a request's block list (``shrink``) and put it back (``unshrink``)."""

    offsets: dict[str, int]
    # blocks a request may hold at most (``bounds.held_tokens``): when set, a request is admitted
    # only while the pool holds what every admitted request may hold (``reserved``), so none is
    # ever preempted; None: vLLM's own admission
    most_blocks: Callable[[Request], int] | None
    reserved: dict[str, int]  # req_id -> its most blocks, while it holds blocks
    # with prefix caching on: the tokens of a request's prompt that may be cached and shared, none
    # of which a compaction moves (``prefix.shared_tokens``); None: caching off
    shared: Callable[[Request], int] | None

    @classmethod
    def adopt(cls, manager: KVCacheManager, offsets: dict[str, int],
              most_blocks: Callable[[Request], int] | None = None,
              shared: Callable[[Request], int] | None = None) -> "SieveKVCacheManager":
        """This class over the state of the manager vLLM's scheduler built (same coordinator, same
        block pool): no second pool, and no copy of vLLM's constructor arguments to keep in step."""
        adopted = cls.__new__(cls)
        adopted.__dict__.update(manager.__dict__)
        adopted.offsets, adopted.most_blocks, adopted.reserved = offsets, most_blocks, {}
        adopted.shared = shared if manager.enable_caching else None
        return adopted

    def get_computed_blocks(self, request):
        """vLLM's prefix-cache hit, cut to the blocks of the request's own shared prefix: a block
        another request may cache beyond it (a pinned prompt under a larger budget) holds tokens
        this request's compactions would move."""
        blocks, hit, boundary = super().get_computed_blocks(request)
        shared = hit if self.shared is None else self.shared(request)
        if hit <= shared:
            return blocks, hit, boundary
        keep = shared // self.block_size
        return self.create_kv_cache_blocks(tuple(list(group[:keep]) for group in blocks.blocks)), \
            keep * self.block_size, 0

    def held(self, request_id: str) -> int:
        """Blocks the request holds now (KV cache group 0)."""
        return len(self.coordinator.single_type_managers[0].req_to_blocks.get(request_id, ()))

    def _growth(self) -> int:
        """Blocks the admitted requests may still take: each one's most, less what it holds now."""
        return sum(max(0, most - self.held(r)) for r, most in self.reserved.items())

    def free(self, request) -> None:
        self.reserved.pop(request.request_id, None)
        super().free(request)

    def pop_blocks_for_free(self, request):
        self.reserved.pop(request.request_id, None)
        return super().pop_blocks_for_free(request)

    def allocate_slots(self, request, num_new_tokens: int, *args, **kwargs):
        need = None
        if self.most_blocks is not None and request.request_id not in self.reserved:
            # a request starting (or, never here, resuming): only if the pool holds its most and
            # what the admitted requests may still take
            need = self.most_blocks(request)
            if need + self._growth() > self.block_pool.get_num_free_blocks():
                return None
            # this admission replaces vLLM's check that the whole prompt fits (a prompt compressed
            # between prefill chunks may be longer than the pool)
            kwargs["full_sequence_must_fit"] = False
        offset = self.offsets.get(request.request_id, 0)
        caching = self.shared is not None and not offset and not kwargs.get("delay_cache_blocks")
        if offset or self.shared is not None:
            # a compacted request's blocks no longer hold its tokens in order: never cache them;
            # with prefix caching, cache only the prompt's shared prefix, below
            kwargs["delay_cache_blocks"] = True
        view = _KVView(request, offset) if offset else request
        blocks = super().allocate_slots(view, num_new_tokens, *args, **kwargs)
        if blocks is None:
            return None
        if need is not None:
            self.reserved[request.request_id] = need
        if caching:  # as vLLM caches after an allocation, up to the shared prefix
            done = request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0) \
                + kwargs.get("num_external_computed_tokens", 0) + num_new_tokens
            self.cache_blocks(request, min(done, request.num_tokens, self.shared(request)))
        return blocks

    def shrink(self, request_id: str, num_tokens: int) -> list[list]:
        """Cut the request's block list, in every group, to the blocks that hold ``num_tokens``; the
        cut tail blocks are returned, still allocated (``release`` or ``unshrink`` them)."""
        held = []
        for manager in self.coordinator.single_type_managers:
            blocks = manager.req_to_blocks[request_id]
            n = blocks_for(num_tokens, manager.block_size)
            held.append(blocks[n:])
            del blocks[n:]
            if request_id in manager.num_cached_block:
                manager.num_cached_block[request_id] = min(manager.num_cached_block[request_id], n)
        return held

    def unshrink(self, request_id: str, held: list[list]) -> None:
        for manager, blocks in zip(self.coordinator.single_type_managers, held):
            manager.req_to_blocks[request_id].extend(blocks)

    def release(self, held: list[list]) -> None:
        for blocks in held:
            if blocks:
                self.block_pool.free_blocks(reversed(blocks))


@dataclasses.dataclass
class SieveSchedulerOutput(SchedulerOutput):
    """vLLM's scheduler output with this step's ``SievePlan`` (pickled to the worker with the rest)."""

    kvsieve_plan: SievePlan | None = None


class SieveScheduler(Scheduler):
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        check_vllm()
        self.sieve = settings_of(vllm_config)
        refuse_unsupported(vllm_config, kv_cache_config, self.sieve)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self.sieve_offsets: dict[str, int] = {}
        self.sieve_preemptions: dict[str, int] = {}  # preemptions already answered by a compression
        # requests longer than the pool (issue 59 item 1): admitted only while the pool holds the most
        # every admitted request may hold, so none is preempted (its recompute would not fit)
        self.sieve_pool_blocks = kv_cache_config.num_blocks - 1  # vLLM keeps block 0 as its null block
        self.sieve_longer = self.sieve.compresses and self.max_model_len > self.sieve_pool_blocks * self.block_size
        self.kv_cache_manager = SieveKVCacheManager.adopt(self.kv_cache_manager, self.sieve_offsets,
                                                          self._most_blocks if self.sieve_longer else None,
                                                          self._shared if self.sieve.compresses else None)
        self.sieve_step = 0
        # vLLM's longest prefill chunk (its long_prefill_token_threshold does not cut a request
        # scheduled alone): a prompt is compressed before each chunk where _chunks says so
        self.sieve_chunk = self.scheduler_config.max_num_batched_tokens
        self.sieve_chunked: set[str] = set()  # requests whose prompt is compressed between prefill chunks
        self.sieve_held: dict[int, list[list[list]]] = {}  # step -> blocks cut that step, freed after it ran
        # req_id -> (its kvsieve_* overrides, its settings): requests with their own, dropped with the request
        self.sieve_requests: dict[str, tuple[dict[str, int], SieveSettings]] = {}
        self.sieve_ended: list[Request] = []  # finished by kvsieve; their outputs go out with the next step's
        self.sieve_stats = {"compactions": 0, "blocks_freed": 0, "refused": 0, "failed": 0}
        logger.info("kvsieve scheduler: %s", effective_settings(self.sieve, self.block_size))

    # ------------------------------------------------------------------ a request's own settings
    def add_request(self, request: Request) -> None:
        """vLLM's, after building the request's own settings when it carries ``kvsieve_*`` keys, or
        refusing it (``_refuse``) when they do not fit this server."""
        if request.request_id in self.requests or request.sampling_params is None:
            return super().add_request(request)  # a streaming session's next input; a pooling request
        try:
            overrides, settings = request_settings(self.sieve, request.sampling_params.extra_args, self.max_model_len)
        except ValueError as err:
            return self._refuse(request, str(err))
        if overrides:
            self.sieve_requests[request.request_id] = (overrides, settings)
        if self.sieve.compresses and self._chunks(request, settings):
            self.sieve_chunked.add(request.request_id)
        most = self._most_blocks(request) if self.sieve.compresses else 0
        if most > self.sieve_pool_blocks:
            chunked = request.request_id in self.sieve_chunked
            self.sieve_chunked.discard(request.request_id)
            how = f"compressed between prefill chunks of {self.sieve_chunk}" if chunked else "then"
            fix = "lower --max-num-batched-tokens (vLLM's prefill chunk)" if chunked else "shorten the prompt"
            return self._refuse(request, f"it may hold {most * self.block_size} tokens of KV (a prompt of {request.num_prompt_tokens} "
                                f"tokens, {how} {settings.method}'s count and schedule), more than the KV pool's "
                                f"{self.sieve_pool_blocks * self.block_size}; {fix}, lower its budget, "
                                "or give the server more KV memory (--kv-cache-memory-bytes)")
        super().add_request(request)

    def _refuse(self, request: Request, why: str) -> None:
        """Finish ``request`` before it is ever scheduled (``_end``)."""
        super().add_request(request)
        self._end(request, "refused", why)

    def _end(self, request: Request, what: str, why: str) -> None:
        """Finish ``request`` with ``FINISHED_ERROR`` and one logged line; the other requests run
        on.  vLLM emits a request's output only from ``update_from_output``, which the engine
        runs after every step while the scheduler has requests, finished ones included
        (``has_requests``): the finished id keeps the engine stepping, even when this request is
        alone in the server, and its output goes out with that step's."""
        logger.warning("kvsieve: request %s %s: %s", request.request_id, what, why)
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self.sieve_ended.append(request)
        self.sieve_stats[what] += 1

    def _chunks(self, request: Request, settings: SieveSettings) -> bool:
        """Whether ``request``'s prompt is compressed between vLLM's prefill chunks, under a method
        whose prompt competes with the output (one that keeps the prompt cannot shrink it): one
        that evicts the prompt block by block (CAOTE's ``prefill_block``; ``engine_kwargs`` makes
        vLLM's chunks its blocks), or a prompt the pool cannot hold whole (issue 59 item 3).  Any
        other prompt is compressed once after prefill, as kvsieve's engine does."""
        policy = settings.policy
        if policy.protect_prompt or policy.pin_prompt:
            return False
        return policy.prefill_block_size() is not None or \
            blocks_for(request.num_prompt_tokens + 1, self.block_size) > self.sieve_pool_blocks

    def _most_blocks(self, request: Request) -> int:
        """Blocks ``request`` may hold at most under its settings (``bounds.held_tokens``): from its
        prompt (or, resumed after a preemption, its prompt and outputs) on; a prompt compressed
        between prefill chunks holds at most its count and one chunk."""
        settings = self._settings_of(request.request_id)[1]
        max_len = min(self.max_model_len, request.num_prompt_tokens + request.max_tokens)
        first = request.num_tokens
        if request.request_id in self.sieve_chunked:
            first = min(first, count_of(settings, request.num_prompt_tokens, max_len) + self.sieve_chunk)
        tokens = held_tokens(settings, self.block_size, request.num_prompt_tokens, max_len, first)
        return blocks_for(tokens, self.block_size)

    def _shared(self, request: Request) -> int:
        """Tokens of ``request``'s prompt that prefix caching may share (``prefix.shared_tokens``)."""
        settings = self._settings_of(request.request_id)[1]
        return shared_tokens(settings.policy, request.num_prompt_tokens, self.block_size)

    def _settings_of(self, req_id: str) -> tuple[dict[str, int], SieveSettings]:
        """The request's overrides and settings (none and the server's, for most)."""
        return self.sieve_requests.get(req_id, ({}, self.sieve))

    # ------------------------------------------------------------------ before and after vLLM's schedule
    def _forget_gone(self) -> None:
        """Offsets of requests finished, aborted or preempted (their KV is gone) are dropped."""
        for req_id in list(self.sieve_offsets):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or request.num_computed_tokens == 0:
                del self.sieve_offsets[req_id]

    def _forget_finished(self) -> None:
        """What is kept of requests finished or aborted (a request's own settings, its preemptions
        answered) is dropped: after every step, so nothing stays once the engine is idle."""
        for kept in (self.sieve_preemptions, self.sieve_requests):
            for req_id in [r for r in kept if r not in self.requests]:
                del kept[req_id]
        self.sieve_chunked.intersection_update(self.requests)

    def _end_unresumable(self) -> None:
        """A preempted request whose recompute (prompt and outputs at full length) the pool cannot
        hold would wait for ever: it is ended, with the reason.  Only where requests may be longer
        than the pool (else every recompute fits), and there admission keeps every request from
        being preempted (``SieveKVCacheManager``): a guard, not a path."""
        if not self.sieve_longer:
            return
        pool = self.sieve_pool_blocks
        for request in [r for r in self.waiting if r.status == RequestStatus.PREEMPTED
                        and blocks_for(r.num_tokens, self.block_size) > pool]:
            self._end(request, "failed", f"it was preempted, and its recompute of {request.num_tokens} tokens cannot "
                      f"fit the KV pool of {pool * self.block_size}")

    def _cut(self) -> dict[str, tuple[Compaction, list[list], int]]:
        """Step 1: cut the block lists of the running requests due for compression.  A request
        whose count cannot be planned is ended alone (``_end``); the others go on."""
        pending, failed = {}, []
        if not self.sieve.compresses:
            return pending
        for request in self.running:
            # prompt (or the recompute after a preemption) done: one sampled token not yet in the KV;
            # or a prompt compressed between prefill chunks, between two of them
            if request.num_tokens - request.num_computed_tokens != 1 and not self._between_chunks(request):
                continue
            try:
                cut = self._cut_one(request)
            except Exception as err:  # noqa: BLE001: any failure is this request's, never the server's
                failed.append((request, f"{type(err).__name__}: {err}"))
                continue
            if cut is not None:
                pending[request.request_id] = cut
        for request, why in failed:
            self._end(request, "failed", f"its compaction could not be planned: {why}")
        return pending

    def _between_chunks(self, request: Request) -> bool:
        """A prompt compressed between prefill chunks (``_chunks``), part of it read, more to come."""
        return request.request_id in self.sieve_chunked and \
            0 < request.num_computed_tokens < request.num_prompt_tokens

    def _cut_one(self, request: Request) -> tuple[Compaction, list[list], int] | None:
        """The request's compaction, its cut blocks and its offset before, or None when none is due."""
        req_id = request.request_id
        old_offset = self.sieve_offsets.get(req_id, 0)
        logical = request.num_computed_tokens
        kv_len = logical - old_offset
        # preempted since the last look: it has just recomputed its prompt and outputs in full
        recomputed = request.num_preemptions > self.sieve_preemptions.get(req_id, 0)
        if recomputed:
            self.sieve_preemptions[req_id] = request.num_preemptions
        overrides, settings = self._settings_of(req_id)
        if self._between_chunks(request):  # down to its count before each chunk of a long prompt
            keep, coming = count_of(settings, request.num_prompt_tokens, logical), \
                min(self.sieve_chunk, request.num_prompt_tokens - logical)
        else:
            keep = keep_count(settings, kv_len, logical - request.num_prompt_tokens, recomputed=recomputed,
                              prompt_len=request.num_prompt_tokens, block_size=self.block_size)
            coming = 1
        if keep is None or keep >= kv_len:
            return None
        block_ids = tuple(self.kv_cache_manager.get_block_ids(req_id)[0])
        # keep the blocks for the kept tokens and this step's new ones (one token, or a prefill
        # chunk): the request reuses its own cut blocks instead of asking the pool for them while
        # its cut blocks are held (the worker reads the old tokens out before the forward pass)
        held = self.kv_cache_manager.shrink(req_id, keep + coming)
        kept_blocks = len(block_ids) - len(held[0])
        self.sieve_offsets[req_id] = logical - keep
        return (Compaction(req_id, block_ids, kv_len, keep, kept_blocks, logical, request.num_prompt_tokens,
                           overrides), held, old_offset)

    def _settle(self, pending, output: SchedulerOutput) -> list[Compaction]:
        """Step 3: keep the cuts of the requests scheduled this step, undo the others."""
        compactions, held_now = [], []
        for req_id, (compaction, held, old_offset) in pending.items():
            request = self.requests.get(req_id)
            if req_id in output.num_scheduled_tokens:
                compactions.append(compaction)
                held_now.append(held)
            elif request is not None and request.status == RequestStatus.RUNNING:
                self.kv_cache_manager.unshrink(req_id, held)  # not scheduled: as it was
                if old_offset:
                    self.sieve_offsets[req_id] = old_offset
                else:
                    self.sieve_offsets.pop(req_id, None)
            else:  # preempted by vLLM in this very schedule(): its other blocks are already free
                self.kv_cache_manager.release(held)
                self.sieve_offsets.pop(req_id, None)
        if held_now:
            self.sieve_held[self.sieve_step] = held_now
        return compactions

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        self.sieve_step += 1
        self._forget_gone()
        self._end_unresumable()
        pending = self._cut()
        output = super().schedule(*args, **kwargs)
        compactions = self._settle(pending, output)
        offsets = {r: self.sieve_offsets[r] for r in output.num_scheduled_tokens if self.sieve_offsets.get(r)}
        plan = SievePlan(self.sieve_step, compactions, offsets)
        self.sieve_stats["compactions"] += len(compactions)
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(SchedulerOutput)}
        return SieveSchedulerOutput(**fields, kvsieve_plan=plan)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output):
        plan = getattr(scheduler_output, "kvsieve_plan", None)
        if plan is not None:  # the step ran: its compactions are done, the cut blocks free
            for held in self.sieve_held.pop(plan.step, ()):
                self.sieve_stats["blocks_freed"] += sum(len(b) for b in held)
                self.kv_cache_manager.release(held)
        # requests the worker could not compress (SieveRunnerOutput): ended before vLLM takes this
        # step's tokens, which it skips for finished requests
        for req_id, why in (getattr(model_runner_output, "kvsieve_failed", None) or {}).items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                self._end(request, "failed", f"its compaction failed: {why}")
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self.sieve_ended:  # as vLLM emits its own per-request errors (grammar, encoder cache)
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason(),
                events=request.take_events(), trace_headers=request.trace_headers))
        self.sieve_ended.clear()
        self._forget_finished()
        return outputs
