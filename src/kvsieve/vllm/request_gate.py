"""The HTTP gate: a request's own kvsieve settings checked against the server's before vLLM reads
the request, answered with HTTP 400 and the reason when they do not fit.

vLLM's OpenAI server takes extra ASGI middleware by import path (its public ``--middleware``
option, vllm/entrypoints/launchers/cli_args.py; repeatable, so a user's own middleware stays);
``kvsieve serve`` adds ``SieveRequestGate``.  Two things only the gate can see:

* the server's settings: a request's ``kvsieve_*`` keys are checked against the served method
  (``plan.request_settings``: a budget below its protected tokens, a recent window above the
  budget), which the logits processor's ``validate_params`` cannot (it sees no server config,
  ``params``), so without the gate such a request reaches the scheduler, which can only finish it
  with an error status: HTTP 500, the reason in the server's log;
* the JSON as the client sent it: vLLM's request models type ``vllm_xargs`` values as
  ``str | int | float``, and pydantic's lax validation turns ``true`` into ``1`` before any hook
  of vLLM sees it.  ``{"kvsieve_budget": true}`` is refused here as the boolean it is.

Everything else passes through untouched: other paths and methods, bodies that are not JSON
objects or carry no ``vllm_xargs`` (vLLM answers its own errors), and the body itself, replayed to
vLLM exactly as received.  The scheduler's check stays (``SieveScheduler.add_request``), for
requests that reach the engine another way (``vllm.LLM``, a server started without the gate).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from .plan import SieveSettings, request_settings, settings_of

# the OpenAI routes whose bodies carry ``vllm_xargs`` (vllm/entrypoints/openai/*/protocol.py)
CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")

Scope = dict[str, Any]
Message = dict[str, Any]


class SieveRequestGate:
    """ASGI middleware (``--middleware kvsieve.vllm.request_gate.SieveRequestGate``): a POST to one of
    ``CHECKED_PATHS`` whose JSON body's ``vllm_xargs`` the server's settings refuse gets HTTP 400
    in vLLM's error shape (``{"error": {"message", "type", "param", "code"}}``); every other
    request goes to vLLM's app as it came."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.server: tuple[SieveSettings, int] | None = None  # settings, max_model_len: read at first use

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_PATHS:
            return await self.app(scope, receive, send)
        messages, body = await read_body(receive)
        why = self.refusal(scope, body)
        if why is not None:
            return await answer_400(send, why)
        await self.app(scope, replay(messages, receive), send)

    def refusal(self, scope: Scope, body: bytes) -> str | None:
        """Why the server refuses the request's ``kvsieve_*`` settings, or None."""
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None  # vLLM answers a malformed body itself
        xargs = payload.get("vllm_xargs") if isinstance(payload, dict) else None
        if not isinstance(xargs, dict) or not any(isinstance(k, str) and k.startswith("kvsieve_") for k in xargs):
            return None
        settings, max_model_len = self.server_settings(scope)
        try:
            request_settings(settings, xargs, max_model_len)
        except ValueError as err:
            return str(err)
        return None

    def server_settings(self, scope: Scope) -> tuple[SieveSettings, int]:
        """The served settings and ``max_model_len``, from the vLLM config vLLM's server keeps on
        its app's state (``state.vllm_config``, vllm/entrypoints/launchers/api_server/app_state.py)."""
        if self.server is None:
            config = scope["app"].state.vllm_config
            self.server = settings_of(config), config.model_config.max_model_len
        return self.server


async def read_body(receive) -> tuple[list[Message], bytes]:
    """Every ``http.request`` message of the request, and their body bytes joined."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    return messages, b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")


def replay(messages: list[Message], receive):
    """A ``receive`` that hands out ``messages`` again, then whatever the client sends next (a
    disconnect, which vLLM watches for to abort a request)."""
    pending = list(messages)

    async def receive_again() -> Message:
        return pending.pop(0) if pending else await receive()

    return receive_again


async def answer_400(send, message: str) -> None:
    """HTTP 400 with ``message`` in vLLM's error body (``ErrorResponse``,
    vllm/entrypoints/serve/engine/protocol.py), as vLLM answers its own bad requests."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "vllm_xargs",
                                 "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
