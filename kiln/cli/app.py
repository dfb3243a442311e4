"""The `kiln` command: one typer app, one module per command.

Each command module exposes ``register(app: typer.Typer) -> None``. Modules are imported
when the app is built, so they must keep heavy imports (torch, transformers) inside their
command functions: ``kiln --help`` stays fast.

``main()`` is the console script. A user-fixable error (``KilnError``, ``ValueError``,
a missing file) becomes one line ``error: <message>`` on stderr and exit code 1; the
traceback is shown only with ``kiln --debug ...`` or ``KILN_DEBUG=1``. A usage error (an
unknown option, a bad value for an option's type, a missing argument) is click's: a usage
message and exit code 2, as for any click / typer program. Ctrl-C exits 130.
"""

from __future__ import annotations

import importlib
import sys
import traceback

import typer

from kiln import __version__, env

# Command modules that register themselves on the root app, in help order.
COMMAND_MODULES = ("quantize", "build", "inspect", "generate", "serve", "eval")
# Command modules that register on the `bench` sub-app.
BENCH_MODULES = ("bench",)

# Help and usage errors in click's plain layout: rich's option tables cut long option names
# at 80 columns (`--max-batch-si…`); the plain layout wraps the help text instead.
HELP_MARKUP = None


def _debug_enabled(argv: list[str]) -> bool:
    if env.debug_enabled():
        return True
    # `--debug` is a root option; it is only meaningful before the sub-command name, but a
    # stray one later is still a clear request for tracebacks.
    return "--debug" in argv


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"kiln {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the kiln version and exit.",
        callback=_version_callback, is_eager=True,
    ),
    debug: bool = typer.Option(
        False, "--debug", help="Show full tracebacks on errors (same as KILN_DEBUG=1).",
    ),
) -> None:
    """kiln: turn a language model into a fast engine, then run, serve and benchmark it."""
    if debug:
        env.enable_debug()


def _register_optional(target: typer.Typer, module_name: str) -> bool:
    """Import ``kiln.cli.<module_name>`` and call its ``register``; skip it if not written yet.

    Only a missing module is skipped: a module that exists but fails to import is a bug and
    raises.
    """
    full = f"kiln.cli.{module_name}"
    try:
        module = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name == full:
            return False
        raise
    register = getattr(module, "register", None)
    if register is None:
        return False
    register(target)
    return True


def build_app() -> tuple[typer.Typer, typer.Typer]:
    """The root app and its `bench` sub-app, with every available command registered."""
    root = typer.Typer(
        name="kiln",
        help="kiln: turn a language model into a fast engine, then run, serve and benchmark it.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=HELP_MARKUP,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    root.callback()(_root)
    bench = typer.Typer(
        name="bench",
        help="Benchmark an engine: offline throughput, latency, or a running server.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=HELP_MARKUP,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    for name in COMMAND_MODULES:
        _register_optional(root, name)
    for name in BENCH_MODULES:
        _register_optional(bench, name)
    root.add_typer(bench, name="bench")
    return root, bench


app, bench_app = build_app()


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip() or type(exc).__name__
    # One line: later lines of a multi-line message are joined, not dropped.
    return " ".join(line.strip() for line in msg.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, map errors to one line and an exit code."""
    from kiln.errors import KilnError

    args = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_enabled(args)
    try:
        app(args=args, prog_name="kiln")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
    except (KilnError, ValueError, FileNotFoundError, NotADirectoryError,
            PermissionError, IsADirectoryError) as e:
        if debug or _debug_enabled([]):
            traceback.print_exc()
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        if debug or _debug_enabled([]):
            traceback.print_exc()
            print(f"error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        else:
            print(
                f"error: {type(e).__name__}: {_one_line(e)} "
                "(internal error; rerun with --debug for the traceback)",
                file=sys.stderr,
            )
        sys.exit(1)


if __name__ == "__main__":
    main()
