"""The CLI entry point: help, version, info, user errors."""

from transformer_cli import __version__

from .conftest import run_tcli


def test_version():
    r = run_tcli("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"tcli {__version__}"


def test_help_lists_commands():
    r = run_tcli("--help")
    assert r.returncode == 0
    assert "info" in r.stdout


def test_info_names_device():
    r = run_tcli("info")
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout and "device cpu" in r.stdout
