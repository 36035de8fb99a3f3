"""``python -m kvsieve.eval eval|report|analyze trace ...``: the harness commands without the main CLI."""

import typer

from .cli import OneLineErrors, register

app = typer.Typer(help="kvsieve evaluation harness.", cls=OneLineErrors, no_args_is_help=True, pretty_exceptions_show_locals=False)
register(app)

if __name__ == "__main__":
    app()
