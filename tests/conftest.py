"""Shared test helpers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT / "data" / "multi30k"


@pytest.fixture(scope="session")
def multi30k() -> Path:
    """The real corpus (CI links ../shared/data/multi30k here)."""
    if not (MULTI30K / "train.de.gz").exists():
        pytest.fail(f"{MULTI30K} is missing: link ../shared/data/multi30k there (see .ci/run)")
    return MULTI30K


def run_tcli(*args: str, input: str | bytes | None = None, cwd: Path | None = None, timeout: float = 600):
    """Run `python -m transformer_cli ARGS` in a subprocess; returns CompletedProcess (text mode)."""
    return subprocess.run(
        [sys.executable, "-m", "transformer_cli", *map(str, args)],
        input=input, capture_output=True, text=not isinstance(input, bytes), cwd=cwd or ROOT,
        timeout=timeout,
    )
