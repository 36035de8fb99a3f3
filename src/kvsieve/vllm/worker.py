"""kvsieve's vLLM CPU worker and model runner: apply the scheduler's compactions to the paged KV
in place before the forward pass, and keep each request's RoPE positions logical while its slot
mapping and attention lengths follow its compacted KV.  Selected with ``worker_cls``
(``kvsieve.vllm.engine_kwargs``); read against vLLM 0.32 (``v1/worker/cpu_worker.py``,
``v1/worker/cpu_model_runner.py``, ``v1/worker/gpu_model_runner.py``: the V1 runner, which the CPU
platform uses while Triton has no CPU backend).

Per step (docs/vllm-design.md, "The worker"):

1. ``execute_model``: forget finished and resumed requests; apply each ``Compaction`` of the plan:
   kvsieve's scorer and schedule choose every (layer, kv head)'s kept tokens over the requests'
   paged KV, the requests of one policy scored together, and they move into each request's first
   slots (``store.compress_requests``); then each request's block-table row is cut to its kept
   blocks (the scheduler has cut its own list the same way, so this step's new blocks append
   after them).  A request that could not be compressed is named in the step's output
   (``SieveRunnerOutput``) with the reason, and the scheduler ends it alone;
2. vLLM's ``_prepare_inputs`` computes positions, slot mapping and sequence lengths from the logical
   ``num_computed_tokens``; ``_prepare_inputs`` here then subtracts each request's offset from the
   sequence lengths and recomputes the slot mapping from ``position - offset``, leaving the
   positions (RoPE) and the input token ids as vLLM made them;
3. ``_model_forward``: for SkipKV (``Needs.sentences``), the forward's output, the final norm's,
   fed with each request's token ids and positions to the sentence table of the live requests
   (``sentences.RequestSentences``), whose rows a compaction selects per batch.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import psutil
import torch
from vllm.distributed import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                              tensor_model_parallel_all_gather)
from vllm.logger import init_logger
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from ..methods.triattention import TriAttention
from ..policy import Policy
from . import check_vllm
from .attention import SieveCPUAttentionImpl, install
from .rings import QueryRecorder
from .metrics import WorkerCounts
from .paged import CpuLayout
from .bounds import held_tokens
from .plan import Compaction, SieveSettings, settings_of
from .preflight import check_stats
from .sentences import RequestSentences, sentence_reader
from .store import RequestState, compress_requests, heads_combiner

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, whose handler prints INFO; ours alone has none
_DEBUG = bool(os.environ.get("KVSIEVE_VLLM_DEBUG"))
LOG_EVERY_S = 30.0  # how often the worker logs the share of step time spent compacting


@dataclasses.dataclass
class SieveRunnerOutput(ModelRunnerOutput):
    """vLLM's model runner output with the requests whose compaction failed this step, each with
    the reason (``store.compress_requests``): the scheduler ends them (``SieveScheduler``) and
    every other request runs on."""

    kvsieve_failed: dict[str, str] = dataclasses.field(default_factory=dict)


class SieveCPUModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self.sieve: SieveSettings = settings_of(vllm_config).for_model(vllm_config.model_config.hf_config)
        check_stats(self.sieve.options, vllm_config.model_config.hf_config)  # refused now, not at a compaction
        self.sieve_policy = self.for_heads(self.sieve.policy)  # kvsieve's Policy: its scorer chooses the kept tokens
        self.sieve_layout = CpuLayout()
        self.sieve_requests: dict[str, RequestState] = {}
        self.sieve_request_policies: dict[str, Policy] = {}  # req_id -> its own Policy (kvsieve_* keys)
        self.sieve_offsets: dict[str, int] = {}
        self.sieve_recorder: QueryRecorder | None = None
        # compactions applied, tokens evicted, blocks freed, seconds spent compacting and in whole
        # steps (the share is logged every LOG_EVERY_S), each step's KV lengths: kvsieve's /metrics
        self.sieve_stats = WorkerCounts()
        self.sieve_failed: dict[str, str] = {}  # req_id -> why this step could not compress it
        self.sieve_logged = time.monotonic()
        # SkipKV's sentence table of the live requests, fed from every forward (``_model_forward``)
        self.sieve_sentences = self._sieve_sentence_table()
        self.sieve_step: tuple[list[str], list[int]] | None = None  # this step's requests and query_start_loc
        self._sieve_ready(self.sieve_policy)

    def _sieve_sentence_table(self) -> RequestSentences | None:
        """For a scorer that reads sentences (``Needs.sentences``: SkipKV), an empty table whose
        sentences end at the model tokenizer's ids of its delimiter texts; None for the rest."""
        scorer = self.sieve_policy.scorer
        if scorer is None or not scorer.needs.sentences:
            return None
        from vllm.tokenizers import cached_tokenizer_from_config

        from ..methods.skipkv import SentenceTable

        tokenizer = cached_tokenizer_from_config(self.model_config)
        if tokenizer is None:
            raise ValueError(f"kvsieve: {self.sieve.method} ends sentences at delimiter tokens, found by the "
                             "model's tokenizer: drop --skip-tokenizer-init")
        if self.model_config.enable_prompt_embeds:
            raise ValueError(f"kvsieve: {self.sieve.method} reads each token's id, which prompt embeddings do not "
                             "have: drop --enable-prompt-embeds")
        return RequestSentences(SentenceTable.of(tokenizer, scorer.needs.sentences))

    def _sieve_ready(self, policy: Policy) -> Policy:
        """``policy`` with its scorer reading this worker's sentence table, if it reads one."""
        if self.sieve_sentences is not None:
            sentence_reader(policy.scorer).read_sentences(self.sieve_sentences.table)
        return policy

    # ------------------------------------------------------------------ KV access
    def get_kv_cache_spec(self) -> dict:
        """vLLM's specs, each full-attention layer's answering vLLM's start-up check with the most a
        request holds under the served method (``bounds.held_tokens`` of a prompt within the
        budget; ``spec.SieveAttentionSpec``): ``max_model_len`` may exceed the KV pool."""
        specs = super().get_kv_cache_spec()
        if not self.sieve.compresses:
            return specs
        from .spec import bounded  # imports vLLM's registry, and registers kvsieve's spec in it

        max_len = self.model_config.max_model_len
        return bounded(specs, held_tokens(self.sieve, self.cache_config.block_size, 0, max_len))

    def _sieve_layers(self) -> tuple[list[str], list[torch.Tensor]]:
        group = self.kv_cache_config.kv_cache_groups[0]
        context = self.compilation_config.static_forward_context
        return list(group.layer_names), [context[name].kv_cache for name in group.layer_names]

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        names, caches = self._sieve_layers()
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        for cache in caches:  # the scheduler's blocks must be the kernel's blocks
            if cache.shape[2] != spec.block_size:
                raise ValueError(f"kvsieve: KV cache blocks of {cache.shape[2]} tokens differ from the "
                                 f"scheduler's {spec.block_size}; not supported")
        # the kernel the CPU backend picked (set on each layer by its metadata builder) fixes the layout
        isas = {getattr(self.compilation_config.static_forward_context[name], "isa", None) for name in names}
        if len(isas) != 1:
            raise ValueError(f"kvsieve: attention layers use several CPU kernels {sorted(map(str, isas))}")
        self.sieve_layout = CpuLayout.for_isa(isas.pop())
        # a request replays at most the queries of the tokens its blocks hold (those since its last
        # compaction, or a prompt or recompute), so no more than the pool's tokens, however long it is
        window = self.sieve.query_window(min(self.model_config.max_model_len, kv_cache_config.num_blocks * spec.block_size))
        if window:
            first = self.compilation_config.static_forward_context[names[0]]
            need = len(names) * self.max_num_reqs * window * first.num_heads * first.head_size \
                * self.model_config.dtype.itemsize
            free = psutil.virtual_memory().available
            logger.info("kvsieve: recording %d queries per request and layer: %.2f GiB", window, need / 2**30)
            if need > free // 2:
                raise ValueError(f"kvsieve: {self.sieve.method} records {window} queries per request and layer, "
                                 f"{need / 2**30:.1f} GiB for max_num_seqs={self.max_num_reqs}, more than half the "
                                 f"{free / 2**30:.1f} GiB free; lower max_num_seqs or max_model_len")
            self.sieve_recorder = QueryRecorder(names, self.max_num_reqs, window, first.num_heads,
                                                first.head_size, self.model_config.dtype)
            for name in names:
                impl = self.compilation_config.static_forward_context[name].impl
                if not isinstance(impl, SieveCPUAttentionImpl):
                    raise RuntimeError("kvsieve: the attention backend override did not take effect")
                impl.recorder = self.sieve_recorder

    # ------------------------------------------------------------------ compaction
    def _sieve_forget(self, scheduler_output) -> None:
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        gone |= {r.req_id for r in scheduler_output.scheduled_new_reqs}
        for req_id in gone:
            self.sieve_requests.pop(req_id, None)
            self.sieve_request_policies.pop(req_id, None)
            if self.sieve_sentences is not None:  # a resumed request recomputes from position 0: fed anew
                self.sieve_sentences.forget(req_id)
            if self.sieve_recorder is not None:
                self.sieve_recorder.forget(req_id)

    @staticmethod
    def for_heads(policy: Policy) -> Policy:
        """``policy`` as this tensor-parallel worker scores with it: a scorer whose settings hold
        every head of the model (TriAttention's statistics) cut to the heads this worker holds;
        any other scorer reads only the heads it is given (``plan.unsplit`` refuses the rest)."""
        parts = get_tensor_model_parallel_world_size()
        if parts == 1 or not isinstance(policy.scorer, TriAttention):
            return policy
        return dataclasses.replace(policy, scorer=policy.scorer.for_heads(get_tensor_model_parallel_rank(), parts))

    @staticmethod
    def combiner(policy: Policy):
        """For a scorer that combines a layer's kv heads (``Needs.aligned_heads``), split over
        tensor-parallel workers: the combination of this worker's scores with the others'
        (``store.heads_combiner``, over vLLM's tensor-parallel group; ``plan.unsplit`` refuses a
        scorer with no ``heads_combined_by``).  None otherwise."""
        if get_tensor_model_parallel_world_size() == 1 or policy.scorer is None \
                or not policy.scorer.needs.aligned_heads:
            return None
        return heads_combiner(policy.scorer.needs.heads_combined_by, lambda t: tensor_model_parallel_all_gather(t, 1))

    def _sieve_policy_of(self, c: Compaction) -> Policy:
        """The policy request ``c.req_id`` is compressed with: the server's, or the one its own
        settings name (``c.overrides``; built once per request, as the scheduler built its settings)."""
        if not c.overrides:
            return self.sieve_policy
        if c.req_id not in self.sieve_request_policies:
            self.sieve_request_policies[c.req_id] = self._sieve_ready(
                self.for_heads(self.sieve.for_request(c.overrides).policy))
        return self.sieve_request_policies[c.req_id]

    def _sieve_compact(self, compactions: list[Compaction]) -> None:
        """Compress this step's requests with the served method (``store.compress_requests``:
        kvsieve's scorer and schedule over their paged KV, the requests of one policy together),
        then cut each request's block-table row to its kept blocks."""
        by_policy: dict[int, tuple[Policy, list]] = {}
        for c in compactions:
            req_state = self.requests[c.req_id]
            if list(req_state.block_ids[0]) != list(c.block_ids):
                raise RuntimeError(f"kvsieve: request {c.req_id}'s blocks differ between scheduler and worker")
            policy = self._sieve_policy_of(c)
            by_policy.setdefault(id(policy), (policy, []))[1].append(
                (self.sieve_requests.setdefault(c.req_id, RequestState()), c))
        names, caches = self._sieve_layers()
        context = self.compilation_config.static_forward_context
        scalings = [float(context[n].impl.scale) for n in names]
        for policy, requests in by_policy.values():
            select = None if self.sieve_sentences is None else self.sieve_sentences.select  # a batch's table rows
            failed = compress_requests(policy, self.sieve_layout, caches, scalings, requests, self.sieve_recorder,
                                       before_scoring=select, combine=self.combiner(policy))
            for req_id, why in failed.items():  # the scheduler ends them after this step (SieveRunnerOutput)
                logger.warning("kvsieve: request %s not compressed, ending it: %s", req_id, why)
            self.sieve_failed.update(failed)
            self.sieve_stats.failed_requests += len(failed)
        for c in compactions:  # the block-table rows: the kept blocks (the scheduler cut its lists the same way)
            req_state = self.requests[c.req_id]
            for ids in req_state.block_ids:
                del ids[c.kept_blocks:]
            row = self.input_batch.req_id_to_index.get(c.req_id)
            if row is not None:
                self.input_batch.block_table.add_row(req_state.block_ids, row)
        stats = self.sieve_stats
        stats.compactions += len(compactions)
        stats.evicted_tokens += sum(c.kv_len - c.keep for c in compactions)
        stats.freed_blocks += sum(len(c.block_ids) - c.kept_blocks for c in compactions)

    def execute_model(self, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        plan = getattr(scheduler_output, "kvsieve_plan", None)
        self._sieve_forget(scheduler_output)
        self.sieve_offsets = {} if plan is None else plan.offsets
        if plan is not None and plan.compactions:
            self._sieve_compact(plan.compactions)
            self.sieve_stats.compact_s += time.perf_counter() - start
        output = super().execute_model(scheduler_output, *args, **kwargs)
        self._sieve_time(start)
        return self._sieve_report(output)

    def sample_tokens(self, *args, **kwargs):
        """vLLM's second half of a step (sampling), counted in the step's time."""
        start = time.perf_counter()
        output = super().sample_tokens(*args, **kwargs)
        self.sieve_stats.step_s += time.perf_counter() - start
        return self._sieve_report(output)

    def _sieve_report(self, output):
        """The step's output, carrying the requests this step failed to compress (``SieveRunnerOutput``)
        for the scheduler to end; as it is when none failed or the step has no output yet."""
        if not self.sieve_failed or not isinstance(output, ModelRunnerOutput):
            return output
        fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(ModelRunnerOutput)}
        output, self.sieve_failed = SieveRunnerOutput(**fields, kvsieve_failed=self.sieve_failed), {}
        return output

    def _sieve_time(self, start: float) -> None:
        """Count the step begun at ``start``; every ``LOG_EVERY_S`` seconds, log the share of step time
        spent compacting so far (what a server's log shows of compaction's cost)."""
        stats = self.sieve_stats
        stats.step_s += time.perf_counter() - start
        stats.steps += 1
        if self.sieve.compresses and time.monotonic() - self.sieve_logged >= LOG_EVERY_S:
            self.sieve_logged = time.monotonic()
            logger.info("kvsieve: %d steps, %d compactions, compacting %.1f%% of step time (%.1f of %.1f s)",
                        stats.steps, stats.compactions, 100 * stats.compact_s / max(stats.step_s, 1e-9),
                        stats.compact_s, stats.step_s)

    # ------------------------------------------------------------------ the two lengths
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        num_reqs = self.input_batch.num_reqs
        total = scheduler_output.total_num_scheduled_tokens
        req_ids = self.input_batch.req_ids[:num_reqs]
        if self.sieve_recorder is not None:
            qsl = self.query_start_loc.np
            self.sieve_recorder.plan(list(req_ids), qsl[:num_reqs].tolist(), qsl[1:num_reqs + 1].tolist())
        if self.sieve_sentences is not None:
            self.sieve_step = (list(req_ids), self.query_start_loc.np[:num_reqs + 1].tolist())
        if self.sieve_offsets:
            offsets = torch.tensor([self.sieve_offsets.get(r, 0) for r in req_ids], dtype=torch.int64)
            if bool(offsets.any()):
                self.seq_lens[:num_reqs] -= offsets.to(self.seq_lens.dtype)
                self.optimistic_seq_lens_cpu[:num_reqs] -= offsets.to(self.optimistic_seq_lens_cpu.dtype)
                req_indices = torch.from_numpy(self.req_indices.np[:total]).long()
                kv_positions = self.positions[:total] - offsets[req_indices]
                self.input_batch.block_table.compute_slot_mapping(
                    num_reqs, self.query_start_loc.gpu[: num_reqs + 1], kv_positions)
        self.sieve_stats.observe_kv(self.seq_lens[:num_reqs].tolist())  # each request's KV tokens, this step's in
        if _DEBUG:  # KVSIEVE_VLLM_DEBUG=1: what this step's attention reads and writes, per request
            bt = self.input_batch.block_table[0]
            logger.info("kvsieve step: %s", {
                "req_ids": list(req_ids), "offsets": self.sieve_offsets, "positions": self.positions[:total].tolist(),
                "seq_lens": self.seq_lens[:num_reqs].tolist(), "slots": bt.slot_mapping.gpu[:total].tolist(),
                "rows": [bt.block_table.np[i, :bt.num_blocks_per_row[i]].tolist() for i in range(num_reqs)]})
        return result

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        """vLLM's forward; its output, the final norm's (the hidden states vLLM's logits are
        computed from), fed with this step's token ids and positions to SkipKV's sentence table
        (``sentences.RequestSentences``): what kvsieve's engine reads with a forward hook on the
        final norm.  Read here, outside the model, it holds compiled or eager alike."""
        output = super()._model_forward(input_ids, positions, *args, **kwargs)
        if self.sieve_sentences is not None and self.sieve_step is not None:
            (req_ids, starts), self.sieve_step = self.sieve_step, None
            total = starts[-1]
            if input_ids is None or not isinstance(output, torch.Tensor) or output.shape[0] < total:
                raise RuntimeError(f"kvsieve: {self.sieve.method} reads each token's id and last hidden state, which "
                                   "this model's forward does not give (input embeddings or auxiliary outputs)")
            self.sieve_sentences.feed(req_ids, starts, input_ids[:total], self.positions[:total], output[:total])
        return output


class SieveCPUWorker(CPUWorker):
    def __init__(self, *args, **kwargs) -> None:
        check_vllm()
        install()  # this worker process's CPU attention backend records queries when asked
        super().__init__(*args, **kwargs)

    def init_device(self) -> None:
        super().init_device()
        # vLLM's CPUWorker builds its runner at the end of init_device; ours replaces it
        self.model_runner = SieveCPUModelRunner(self.vllm_config, torch.device("cpu"))

    def kvsieve_stats(self) -> dict:
        """The runner's counts so far (``metrics.WorkerCounts``: compactions, tokens evicted, blocks
        freed, seconds compacting and stepping, KV lengths), for ``LLM.collective_rpc("kvsieve_stats")``
        and the server's /metrics (vLLM's public call into every worker)."""
        return self.model_runner.sieve_stats.as_dict()
