"""scripts/triattention_calibration_size.py (issue 51, "Calibration"): its rank figures on hand-computed
cases, its refusals before any model loads, and the calibration defaults that cite their measurement."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "triattention-calibration.md"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("triattention_calibration_size",
                                                  ROOT / "scripts" / "triattention_calibration_size.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_spearman_and_overlap_on_hand_computed_cases(script):
    a = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.7]])
    assert float(script.spearman(a, a)) == pytest.approx(1.0)
    assert float(script.spearman(a, -a)) == pytest.approx(-1.0)
    # ranks 0 3 1 2 4 against 0 1 2 3 4: d^2 = 0 + 4 + 1 + 1 + 0 = 6, rho = 1 - 6 * 6 / (5 * 24) = 0.7
    b = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    c = torch.tensor([[1.0, 4.0, 2.0, 3.0, 5.0]])
    assert float(script.spearman(c, b)) == pytest.approx(0.7)
    # top-2 of a: {3, 4}, of b: {3, 4}; top-3 of a: {1, 3, 4}, of b: {2, 3, 4}: 2 of 3 shared
    assert float(script.overlap(a, b, 2)) == 1.0
    assert float(script.overlap(a, b, 3)) == pytest.approx(2 / 3)


def test_calibrate_specs_parse_and_refuse(script):
    assert script.parse_spec("32768") == (32768, 1024, 0)
    assert script.parse_spec("8192:8192") == (8192, 8192, 0)
    assert script.parse_spec("4096:1024:2000") == (4096, 1024, 2000)
    for bad in ("", "x", "1:2:3:4", "1", "4096:1", "4096:1024:-1"):
        with pytest.raises(script.UsageError, match="--calibrate"):
            script.parse_spec(bad)


def test_bad_arguments_are_refused_before_the_model_loads(script, capsys, tmp_path):
    assert script.main(["--calibrate", "4096"]) == 2
    assert "at least two statistics" in capsys.readouterr().err
    assert script.main(["--calibrate", "64", "--calibrate", "128", "--budgets", "4096"]) == 2
    assert "keeps the whole cache" in capsys.readouterr().err
    assert script.main(["--stats", str(tmp_path / "a.pt"), "--calibrate", "64",
                        "--data", str(ROOT / "README.md")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    assert "--calibrate" in capsys.readouterr().out


def test_default_calibration_size_is_one_constant_that_cites_the_official_size_and_the_measurement():
    from typer.main import get_command

    from kvsieve.analysis import qk
    from kvsieve.cli import app

    assert inspect.signature(qk.calibrate).parameters["tokens"].default == qk.CALIBRATION_TOKENS
    assert inspect.signature(qk.calibrate).parameters["chunk"].default == qk.CALIBRATION_CHUNK
    command = get_command(app).commands["calibrate"].commands["triattention"]
    defaults = {p.name: p.default for p in command.params}
    assert (defaults["tokens"], defaults["chunk"]) == (qk.CALIBRATION_TOKENS, qk.CALIBRATION_CHUNK)
    assert qk.OFFICIAL_CALIBRATION_TOKENS == 32768  # the official scripts/calibrate.py --max-length
    from kvsieve.analysis import commands

    source = inspect.getsource(commands)
    assert "scripts/calibrate.py" in source and "docs/triattention-calibration.md" in source
    doc = DOC.read_text(encoding="utf-8")
    assert f"{qk.CALIBRATION_TOKENS:,}" in doc and f"{qk.OFFICIAL_CALIBRATION_TOKENS:,}" in doc
    assert "scripts/triattention_calibration_size.py" in doc
