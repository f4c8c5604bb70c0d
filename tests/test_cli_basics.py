"""The CLI entry point: help, version, info, user errors."""

from transformer_cli import __version__

from .conftest import ROOT, run_tcli


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
    assert f"package {ROOT.resolve() / 'transformer_cli'}" in r.stdout.splitlines()  # run from ROOT: this checkout


def test_onednn_primitive_cache_is_capped_unless_the_user_set_it():
    """Importing the package caps oneDNN's primitive cache (long bf16 trainings), never overriding the user."""
    import os
    import subprocess
    import sys

    code = "import os, transformer_cli; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "64"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"
