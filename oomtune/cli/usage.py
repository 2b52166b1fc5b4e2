"""A command line that does not parse (an unknown option, a value of the wrong type, a missing --config): one line
on stderr naming it and the command's --help, and exit 2, as for any other bad input; under --json also
{"error", "exit_code"} on stdout, where a CI script reads every ending. Click would print a boxed usage screen and
nothing on stdout."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading

import typer
from rich.markup import escape
from typer.core import TyperGroup

from ..errors import capped
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
            command, where = self._failed_command(e, argv)
            message = capped(f"{e.format_message()} (see `{where} --help`)".replace("\n", " "))
            err.print(f"[bold red]error:[/] {escape(message)}")
            takes_json = command is not None and any("--json" in getattr(p, "opts", ()) for p in command.params)
            if "--json" in argv and takes_json:  # (train has no --json: `--json` is then the mistake itself)
                print_json(json.dumps({"error": message, "exit_code": e.exit_code}, indent=2))
            sys.exit(e.exit_code)
        except click_errors.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:
            err.print("Aborted!")
            sys.exit(1)
        code = code if isinstance(code, int) else 0
        if args is None:  # (a process of its own, not a test's runner in-process)
            leave_threads_behind(code)
        sys.exit(code)

    def _failed_command(self, e, argv: list[str]) -> tuple:
        """(the command whose line did not parse, its name as `oomtune estimate`). An option missing its value
        (`--budget` last) fails with no context, or the group's, and the command is the first word of the line
        that names one."""
        if e.ctx is not None and e.ctx.command is not self:
            return e.ctx.command, e.ctx.command_path
        top = e.ctx.command_path if e.ctx is not None else "oomtune"
        name = next((a for a in argv if a in self.commands), None)
        return (self.commands[name], f"{top} {name}") if name else (None, top)


def leave_threads_behind(code: int) -> None:
    """The work is done; where a thread the model file started is still running and is no daemon (a `threading.
    Thread(...).start()` at import or in build_model), Python would wait for it at exit, for ever (a CI job hangs
    after its config is written): say which, and end the process now with the command's exit code."""
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not left:
        return
    names = ", ".join(repr(t.name) for t in left)
    err.print(f"[yellow]warning:[/] the model file left {len(left)} thread(s) running ({escape(names)}), which "
              "Python would wait for at exit: exiting without them (start them with daemon=True, or join them)")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
