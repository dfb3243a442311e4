"""`kiln eval perplexity ENGINE`: accuracy checks of a built engine."""

from __future__ import annotations

import json
from pathlib import Path

import typer

eval_app = typer.Typer(
    name="eval", help="Evaluate an engine's accuracy (perplexity on a text set).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help layout, as kiln.cli.app.HELP_MARKUP says
    context_settings={"help_option_names": ["-h", "--help"]},
)


@eval_app.command("perplexity")
def perplexity(
    engine: Path = typer.Argument(..., metavar="ENGINE", help="Engine directory."),
    data: str | None = typer.Option(
        None, "--data",
        help="Text: a .txt file (documents separated by a line =====) or a .jsonl file with a "
        "\"text\" field; default: kiln's built-in evaluation set.",
    ),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window (<= max_seq_len)."),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default: auto)."),
    as_json: bool = typer.Option(
        False, "--json", help='Print {"perplexity": ..., "tokens": ...} as JSON on stdout.'
    ),
) -> None:
    """Token-weighted perplexity of ENGINE over the built-in eval set (or --data)."""
    from kiln.eval.perplexity import perplexity as run

    # the bar goes to stderr and shows only on a terminal, so --json output stays clean
    result = run(engine, data=data, seq_len=seq_len, device=device, progress=True)
    if as_json:
        typer.echo(json.dumps({"perplexity": result["perplexity"], "tokens": result["tokens"]}))
        return
    from rich.console import Console

    q = result["quantization"]
    Console().print(
        f"perplexity [bold]{result['perplexity']:.4f}[/] over {result['tokens']} tokens "
        f"({result['windows']} windows of {result['seq_len']}, {result['data']}); engine "
        f"{result['dtype']}, weights {q['weights']}, kv {q['kv_cache']}, lm_head "
        f"{q['lm_head']}, {result['device']}, {result['seconds']} s"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")
