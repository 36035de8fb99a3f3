"""What the CLI tests share: the usage error of a refused ``kvsieve`` command as one line."""

from __future__ import annotations

from typer.testing import CliRunner

from kvsieve.cli import app

runner = CliRunner()


def usage_error(*args) -> str:
    """The usage error of ``kvsieve ARGS`` as one line (rich boxes and wraps it), checked to be a
    usage error (exit 2) with no traceback."""
    result = runner.invoke(app, list(args), env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.replace("│", " ").split())
    return text[text.index("Invalid value"):].split(" ╰")[0]
