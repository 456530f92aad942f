"""The console commands (pyproject's scripts): ``rlhf-registry``, ``rlhf-model``, ``rlhf-review``,
``rlhf-housekeeping`` and ``rlhf-experiments``; each also runs as ``python -m tasks.cli.<command>``. Each runs
through :func:`run_command`."""

from __future__ import annotations

import os
import sys


def run_command(app) -> None:
    """Run a typer ``app`` as a console command: an error in the command line (an unknown option, a missing or bad
    argument) is one line on stderr naming the command and where its help is, exit 2, instead of click's framed
    box; everything else as typer runs it.
    """
    import typer

    # click's exception classes, which typer may carry inside itself (0.26: typer._click): the bases of BadParameter
    bases = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "rlhf"
    try:
        code = typer.main.get_command(app).main(args=sys.argv[1:], prog_name=prog, standalone_mode=False)
    except bases["ClickException"] as err:
        ctx = getattr(err, "ctx", None)
        where = ctx.command_path if ctx is not None else prog
        message = " ".join(err.format_message().split())
        typer.echo(f"{where}: {message} (see {where} --help)", err=True)
        raise SystemExit(err.exit_code) from None
    except typer.Exit as err:
        raise SystemExit(err.exit_code) from None
    except typer.Abort:
        typer.echo("Aborted.", err=True)
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)  # a command's typer.Exit(n) comes back as n
