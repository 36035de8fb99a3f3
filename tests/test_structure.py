"""Mechanical checks of the layering issue 48 asks for: who may import whom, and how big the
contract and the per-token path are.  They read the source (``ast``) or watch a decode step; none
of them trusts a docstring."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import kvsieve
from kvsieve.policy import Scorer

SRC = Path(kvsieve.__file__).parent
METHODS = SRC / "methods"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, as a dotted name relative to the ``kvsieve`` package
    (``policy``, ``methods.tova``, ``methods._common``); third-party imports are left out."""
    package = path.relative_to(SRC).parent.parts  # () for top-level modules, ("methods",) below
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                stem = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("kvsieve"):
                stem = node.module[len("kvsieve."):] if node.module != "kvsieve" else ""
            else:
                continue
            for alias in node.names:  # ``from . import x`` may name a module x
                found.add(f"{stem}.{alias.name}".lstrip(".") if not node.module else stem)
        elif isinstance(node, ast.Import):
            found.update(a.name[len("kvsieve."):] for a in node.names if a.name.startswith("kvsieve."))
    return found


def test_the_cache_imports_neither_the_policy_nor_the_methods_and_never_receives_a_policy():
    imports = imported_modules(SRC / "cache.py")
    assert not {m for m in imports if m.split(".")[0] in ("policy", "methods", "schedule")}, imports
    tree = ast.parse((SRC / "cache.py").read_text(encoding="utf-8"))
    names = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not {"policy", "scorer", "Policy", "Scorer"} & names


@pytest.mark.parametrize("path", sorted(METHODS.glob("*.py")), ids=lambda p: p.name)
def test_no_method_imports_another_methods_module(path):
    """Method files import core modules and the shared helpers (``methods/_*.py``), never
    another method's file (nor the package, which imports every method)."""
    for module in imported_modules(path):
        if module.startswith("methods."):
            assert module.split(".")[1].startswith("_") or module == "methods.register_wrapper", (path.name, module)


def test_the_scorer_contract_has_at_most_ten_public_members():
    public = {n for n in vars(Scorer) if not n.startswith("_")} - {f.name for f in dataclasses.fields(Scorer)}
    assert len(public) <= 10, sorted(public)


def test_policy_py_stays_a_short_contract():
    lines = (SRC / "policy.py").read_text(encoding="utf-8").count("\n")
    assert lines < 400, lines


def test_no_core_module_imports_upwards():
    """Core (cache, engine, attention, policy, schedule, session) imports nothing from the methods,
    the evaluation, the CLI or ``generate``."""
    core = ("cache", "engine", "attention", "policy", "schedule", "session", "allocators", "hooks")
    for name in core:
        upward = {m for m in imported_modules(SRC / f"{name}.py")
                  if m.split(".")[0] in ("methods", "eval", "cli", "generate", "hf")}
        assert not upward, (name, upward)


@pytest.mark.parametrize("method,settings", [("tova", {}), ("snapkv", {"interval": 2, "recent": 2}), ("caote:tova", {})])
def test_a_decoded_token_passes_through_at_most_five_files(smollm, method, settings):
    """The files a decode step runs, from ``generate``'s loop down to the cache and back, the
    method's own code apart (its file, the shared helpers under ``methods/`` and the ``Scorer``
    base class in ``policy.py``): ``docs/how-a-token-flows.md`` names each of them."""
    from kvsieve import GenerateConfig
    from kvsieve.generate import left_pad, sample
    from kvsieve.methods import make_policy
    from kvsieve.session import DecodeSession

    model, tok = smollm
    ids, pos = left_pad([tok("Count to ten: one, two,").input_ids], 0, model.device)
    policy = make_policy(method, 8, **settings)
    session = DecodeSession(model, policy, batch_size=1, horizon=ids.shape[1] + 8)
    config = GenerateConfig(max_new_tokens=8)
    seen: set[str] = set()

    def watch(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(SRC)):
            seen.add(str(Path(frame.f_code.co_filename).relative_to(SRC)))

    with session.attached(tok), torch.inference_mode():
        token = sample(session.prefill(ids, pos), config, None)
        sys.setprofile(watch)
        try:
            for _ in range(4):  # in-step evictions (tova, caote:tova) and a compression after the pass (snapkv)
                token = sample(session.step(token), config, None)
        finally:
            sys.setprofile(None)
    engine = {f for f in seen if not f.startswith("methods/") and f != "policy.py"}
    assert "generate.py" in engine and len(engine) <= 5, sorted(engine)
    assert session.compression_events[0] > 0
