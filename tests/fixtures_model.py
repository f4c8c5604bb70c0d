"""A trained smoke model shared by the decoding tests (session scope: trained once per test run).

Import the fixtures into a test module with `from .fixtures_model import smoke_run, one_thread  # noqa: F401`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import ROOT, run_tcli

# configs/smoke.yaml, shortened: the decoding tests need a model that ends its sentences, not a good one.
SMOKE_SETS = {"train.max_steps": 60, "train.valid_every": 60, "train.threads": 1}


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, multi30k) -> Path:
    """A run dir trained by `tcli train --config configs/smoke.yaml` (full Multi30k test split prepared)."""
    run_dir = tmp_path_factory.mktemp("decode") / "smoke"
    sets = [w for k, v in SMOKE_SETS.items() for w in ("--set", f"{k}={v}")]
    result = run_tcli("train", "--config", ROOT / "configs" / "smoke.yaml", "--run-dir", run_dir,
                      "--set", f"data.path={multi30k}", *sets, "--quiet")
    assert result.returncode == 0, result.stderr
    assert (run_dir / "checkpoints" / "best").is_dir()
    return run_dir


@pytest.fixture(scope="module")
def one_thread():
    """Decode in-process with one thread: small ops on a shared CPU are slower with more (and it is restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def env_one_thread() -> dict:
    """Environment for tcli subprocesses pinned to one thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def tcli(*args, input=None, timeout=300):
    """run_tcli with one CPU thread (the CPU is shared; many threads on tiny ops only wait)."""
    return subprocess.run([sys.executable, "-m", "transformer_cli", *map(str, args)], input=input,
                          capture_output=True, cwd=ROOT, timeout=timeout, env=env_one_thread(),
                          text=not isinstance(input, bytes))
