"""A command line that does not parse (an unknown option, a value of the wrong type, a missing --config): one line
on stderr naming it and the command's --help, and exit 2, as for any other bad input; under --json also
{"error", "exit_code"} on stdout, where a CI script reads every ending. Click would print a boxed usage screen and
nothing on stdout."""

from __future__ import annotations

import json
import sys

import typer
from rich.markup import escape
from typer.core import TyperGroup

from .console import err
from .guard import print_json

try:  # typer 0.2x carries its own copy of click, whose exceptions these are
    from typer._click import exceptions as click_errors
except ImportError:  # earlier typer runs on click itself
    from click import exceptions as click_errors


class OneLineUsageErrors(TyperGroup):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click_errors.NoArgsIsHelpError as e:  # `oomtune` alone: the help, as before
            e.show()
            sys.exit(e.exit_code)
        except click_errors.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "oomtune"
            message = f"{e.format_message()} (see `{where} --help`)".replace("\n", " ")
            err.print(f"[bold red]error:[/] {escape(message)}")
            takes_json = e.ctx is not None and any("--json" in getattr(p, "opts", ()) for p in e.ctx.command.params)
            if "--json" in argv and takes_json:  # (train has no --json: `--json` is then the mistake itself)
                print_json(json.dumps({"error": message, "exit_code": e.exit_code}, indent=2))
            sys.exit(e.exit_code)
        except click_errors.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:
            err.print("Aborted!")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)
