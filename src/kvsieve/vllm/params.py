"""The check of a request's own kvsieve settings before vLLM queues it.

A request sets its own budget, interval, sinks or recent window with ``kvsieve_*`` keys of its
``SamplingParams.extra_args`` (the OpenAI server's ``vllm_xargs``; ``plan.REQUEST_KEYS``).  A bad
value must never reach the engine core, where an exception in the scheduler stops the engine.
vLLM's public hook for checking a request's sampling parameters is a logits processor's
``validate_params`` (v1/sample/logits_processor/interface.py), which the input processor runs for
every request before it is queued (v1/engine/input_processor.py, ``_validate_params``); the
OpenAI server answers its ``VLLMValidationError`` with HTTP 400.  So the check rides on a logits
processor that changes no logit: argmax-invariant, and its ``apply`` returns the logits as given.
``kvsieve.vllm.engine_kwargs`` registers it (``logits_processors``), which ``kvsieve serve`` passes on.

``validate_params`` sees no server config: it checks the keys and their types and ranges only.
Whether the values fit the server's method (a budget below its protected tokens, one LagKV cannot
fit) is the scheduler's to decide, when the request is added (``SieveScheduler.add_request``).
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from .plan import request_overrides


class SieveRequestCheck(LogitsProcessor):
    """A request's ``kvsieve_*`` keys checked before it is queued (``plan.request_overrides``);
    no effect on sampling."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        try:
            request_overrides(sampling_params.extra_args)
        except ValueError as err:
            raise VLLMValidationError(str(err)) from None

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
