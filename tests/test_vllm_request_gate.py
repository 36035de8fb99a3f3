"""The HTTP gate (``kvsieve.vllm.request_gate``) as vLLM's server runs it: an ASGI middleware in
front of an app, here a recording stand-in for vLLM's, with the server's config on the app's state
as vLLM keeps it.  Plain Python, no vLLM: the served server's 400s are in test_vllm_server.py."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from kvsieve.vllm.request_gate import SieveRequestGate

MAX_MODEL_LEN = 1024


class RecordingApp:
    """vLLM's app as the gate sees it: what it was called with, and the body it read."""

    def __init__(self, kvsieve_config: dict):
        model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN)
        self.state = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"kvsieve": kvsieve_config},
                                                                 model_config=model_config))
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def post(app: RecordingApp, body: bytes, path: str = "/v1/completions", chunk: int = 7) -> tuple[int, bytes]:
    """``body`` POSTed through the gate in pieces of ``chunk`` bytes: the status and body answered."""
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    incoming = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    incoming.append({"type": "http.disconnect"})
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "app": app}
    asyncio.run(SieveRequestGate(app)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


STREAMING = {"method": "streaming", "budget": 64, "interval": 16}


def completion(**xargs) -> bytes:
    return json.dumps({"model": "m", "prompt": "Hi", "max_tokens": 8, "vllm_xargs": xargs}).encode()


@pytest.mark.parametrize("xargs, line", [
    # what the scheduler could only answer with an error status (HTTP 500, the reason in the log)
    ({"kvsieve_budget": 1}, "kvsieve: streaming: budget 1 is smaller than the protected tokens: sinks 4 + recent 0; "
                            "raise kvsieve_budget to at least 4 or lower sinks/recent"),
    ({"kvsieve_recent": 100}, "kvsieve: streaming: budget 64 is smaller than the protected tokens: sinks 4 + "
                              "recent 100; raise kvsieve_budget to at least 104 or lower sinks/recent"),
    # a boolean is not an integer (vLLM's request model would have made it 1)
    ({"kvsieve_budget": True}, "kvsieve: kvsieve_budget must be an integer, got True (bool)"),
    ({"kvsieve_budgett": 32}, "kvsieve: unknown per-request setting 'kvsieve_budgett' (did you mean kvsieve_budget?); "
                              "known: kvsieve_budget, kvsieve_interval, kvsieve_sinks, kvsieve_recent (the method "
                              "and its options are the server's)"),
])
def test_settings_the_server_refuses_are_http_400_with_the_reason_and_never_reach_vllm(xargs, line):
    app = RecordingApp(STREAMING)
    status, body = post(app, completion(**xargs))
    assert status == 400 and app.bodies == []
    assert json.loads(body) == {"error": {"message": line, "type": "BadRequestError", "param": "vllm_xargs",
                                          "code": 400}}


def test_a_full_server_refuses_any_kvsieve_key_at_the_gate():
    status, body = post(RecordingApp({"method": "full"}), completion(kvsieve_budget=32))
    assert status == 400 and "this server evicts nothing (method full)" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("body, path", [
    (completion(kvsieve_budget=32, kvsieve_recent=8), "/v1/completions"),  # fits: goes on
    (completion(other_key=True), "/v1/chat/completions"),  # not kvsieve's
    (b'{"prompt": "no xargs"}', "/v1/completions"),
    (b'{"broken json', "/v1/completions"),  # vLLM answers it itself
    (completion(kvsieve_budget=1), "/v1/models"),  # not a generation route
])
def test_everything_else_reaches_vllm_byte_for_byte(body, path):
    app = RecordingApp(STREAMING)
    assert post(app, body, path) == (200, b"ok")
    assert app.bodies == [body]
