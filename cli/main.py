"""`partc` console script (click). Each command parses options and calls into `partc`.

User errors (PartcError) print one line, `partc: error: ... (hint: ...)`, and exit 2; a bug prints
one line and exits 3. `partc --debug ...` (or PARTC_DEBUG=1) shows the traceback instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator

import click

from partc.errors import PartcError

INTERNAL_ERROR_EXIT = 3


def _version() -> str:
    try:
        return version("partc")
    except PackageNotFoundError:
        return "unknown"


class PartcGroup(click.Group):
    """Turns partc errors into one clear line and an exit code instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except PartcError as exc:
            if _debug(ctx):
                traceback.print_exc()
            click.echo(f"partc: error: {exc.one_line()}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("partc: interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:  # a partc bug: still one line unless --debug
            if _debug(ctx):
                traceback.print_exc()
            click.echo(f"partc: internal error: {type(exc).__name__}: {exc} "
                       "(hint: rerun with --debug for the traceback and report it)", err=True)
            ctx.exit(INTERNAL_ERROR_EXIT)


def _debug(ctx: click.Context) -> bool:
    return bool(ctx.find_root().meta.get("partc.debug")) or os.environ.get("PARTC_DEBUG") == "1"


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().meta["partc.debug"] = True


def debug_option(f: Any) -> Any:
    """--debug, accepted before or after the command name."""
    return click.option("--debug", is_flag=True, expose_value=False, is_eager=True,
                        callback=_set_debug, help="Show full tracebacks on errors.")(f)


@contextlib.contextmanager
def writing_to(path: Path) -> Iterator[None]:
    """Turn an OSError while writing `path` into a one-line user error."""
    try:
        yield
    except OSError as exc:
        raise PartcError(f"cannot write {path}: {exc.strerror}",
                         hint="choose a writable output path") from exc


@click.group(cls=PartcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@debug_option
@click.version_option(_version(), prog_name="partc")
def cli() -> None:
    """partc: ahead-of-time partition compiler for training PyTorch models across devices."""


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size to capture the model at.")
@click.option("--depth", "-d", type=click.IntRange(min=0), default=1, show_default=True,
              help="Module-tree depth of the table (0: whole model, 1: the root's children, ...).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the summary as JSON to this file.")
@click.option("--save", "save_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write the OpGraph (graph.json) and the weightless ONNX model (model.onnx) here.")
@click.option("--no-onnx", is_flag=True, help="Skip the ONNX export (FX-only OpGraph).")
@debug_option
def inspect(model: Path, batch_size: int, depth: int, json_out: Path | None,
            save_dir: Path | None, no_onnx: bool) -> None:
    """Capture MODEL (a model file) and print parameters, FLOPs and activations per module."""
    from partc.module_summary import format_table, summarize_modules
    from partc.pipeline import capture_graph
    from partc.progress import TerminalProgress

    progress = TerminalProgress()
    result = capture_graph(model, batch_size, onnx=not no_onnx, progress=progress)
    if save_dir is not None:
        with writing_to(save_dir):
            written = result.save(save_dir)
        for kind, path in written.items():
            click.echo(f"wrote {kind}: {path}", err=True)
    summary = summarize_modules(result.graph, depth)
    click.echo(format_table(summary))
    if json_out is not None:
        with writing_to(json_out):
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(summary.to_dict(), indent=2, sort_keys=True) + "\n")
        click.echo(f"wrote {json_out}", err=True)


def main() -> None:
    cli(prog_name="partc")


if __name__ == "__main__":
    sys.exit(main())
