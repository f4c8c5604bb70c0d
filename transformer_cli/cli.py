"""The `tcli` command line: one thin function per command (parse, call the library, exit code)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import __version__
from .errors import ConfigError, TcliError

app = typer.Typer(
    name="tcli",
    help="Train, run and evaluate encoder-decoder Transformers for machine translation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Options shared by the commands that read a config.
ConfigOpt = typer.Option(..., "--config", "-c", help="YAML config file.", show_default=False)
SetOpt = typer.Option(None, "--set", help="Override a config key: --set train.lr=3e-4 (repeatable).")
RunDirOpt = typer.Option(None, "--run-dir", help="Run directory (default: run_dir from the config).")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bars or logs on stderr.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for user errors (or set TCLI_DEBUG=1)."),
) -> None:
    """Train, run and evaluate encoder-decoder Transformers for machine translation."""
    if debug:
        os.environ["TCLI_DEBUG"] = "1"


def load_cli_config(config: Path, sets: Optional[List[str]], run_dir: Optional[Path]):
    """Load a config with --set overrides and an optional --run-dir override."""
    from .config import load_config

    cfg = load_config(config, sets)
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    return cfg


@app.command()
def info() -> None:
    """Print the versions of tcli and torch and the device that would be used."""
    import platform

    import torch

    from .device import resolve_device

    device = resolve_device("auto")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    typer.echo(f"tcli {__version__}")
    typer.echo(f"torch {torch.__version__}")
    typer.echo(f"python {platform.python_version()}")
    typer.echo(f"device {device.type} ({name}, {torch.get_num_threads()} CPU threads)")


@app.command("config")
def config_cmd(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file (default: built-in defaults)."),
    sets: Optional[List[str]] = SetOpt,
    run_dir: Optional[Path] = RunDirOpt,
    doc: bool = typer.Option(False, "--doc", help="Print the reference of every config key (Markdown)."),
) -> None:
    """Print the resolved config (after --set overrides) as YAML, or the key reference with --doc."""
    import yaml

    from .config import config_doc, load_config

    if doc:
        typer.echo(config_doc(), nl=False)
        return
    cfg = load_config(config, sets)
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    typer.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False), nl=False)


@app.command()
def prepare(
    config: Path = ConfigOpt,
    sets: Optional[List[str]] = SetOpt,
    run_dir: Optional[Path] = RunDirOpt,
    quiet: bool = QuietOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Read, clean, tokenize and encode the config's data into the run directory (cached)."""
    import json

    from .data import format_summary, prepare as prepare_data

    cfg = load_cli_config(config, sets, run_dir)
    summary = prepare_data(cfg, Path(cfg.run_dir), quiet=quiet)
    typer.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))


@app.command()
def download(
    name: str = typer.Argument(..., help="Data set to fetch: multi30k."),
    dest: Optional[Path] = typer.Option(None, "--dest", help="Target folder (default: data/NAME)."),
    base_url: Optional[str] = typer.Option(None, "--base-url", help="Mirror URL holding the files (http(s):// or file://)."),
    quiet: bool = QuietOpt,
) -> None:
    """Fetch a public data set's files and check their sha256 sums (Multi30k task 1: de, en, fr)."""
    from .download import download_dataset

    for path in download_dataset(name, dest or Path("data") / name, base_url=base_url, quiet=quiet):
        typer.echo(str(path))


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: run the app, turning user errors into `error: ...` and an exit code."""
    try:
        app(args=argv, prog_name="tcli", standalone_mode=True)
    except TcliError as e:
        if os.environ.get("TCLI_DEBUG") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


__all__ = ["app", "main", "load_cli_config", "ConfigError"]
