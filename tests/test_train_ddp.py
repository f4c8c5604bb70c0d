"""Distributed training: 2 CPU processes under torchrun (gloo) match 1 process with the same global batch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from transformer_cli.plots import read_metrics

from .conftest import ROOT, run_tcli
from .test_train import tiny_data, tiny_settings  # noqa: F401 - tiny_data is a fixture

# Dropout off: with it the ranks draw different masks than one process, and only the float
# summation order of the gradients differs between the two runs.
REL_TOLERANCE = 1e-3


def settings(data) -> list[str]:
    return tiny_settings(data) + ["--set", "train.max_steps=15", "--set", "model.dropout=0"]


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r.get("train_loss", r.get("valid_loss"))) for r in read_metrics(run_dir)]


def test_two_ranks_match_one_process_with_update_freq_2(tiny_data, tmp_path):  # noqa: F811
    ddp_dir, one_dir = tmp_path / "ddp", tmp_path / "one"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "transformer_cli", "train", "--config", "configs/smoke.yaml", "--run-dir", str(ddp_dir),
           *settings(tiny_data)]
    ddp = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    summary = json.loads(ddp.stdout.strip().splitlines()[-1])  # only rank 0 prints
    assert summary["step"] == 15 and summary["stopped"] == "max_steps"
    assert sorted(p.name for p in (ddp_dir / "checkpoints").iterdir()) == ["best", "last", "step_00000015"]

    for name in ("data", "tokenizer"):  # same prepared data: skip a second prepare
        shutil.copytree(ddp_dir / name, one_dir / name)
    one = run_tcli("train", "--config", "configs/smoke.yaml", "--run-dir", one_dir, *settings(tiny_data),
                   "--set", "train.update_freq=2")
    assert one.returncode == 0, one.stderr
    a, b = losses(ddp_dir), losses(one_dir)
    assert [s for s, _ in a] == [s for s, _ in b] == [5, 10, 15, 15]
    for (_, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, rel=REL_TOLERANCE)


def test_two_ranks_train_on_the_one_subword_sample_rank_0_draws(tiny_data, tmp_path):  # noqa: F811
    """Under subword sampling rank 0 draws and saves the epoch's sample and both ranks load it: the run
    steps in lockstep (different samples would give the ranks different batch lists) and resumes."""
    run_dir = tmp_path / "ddp_sampled"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "transformer_cli", "train", "--config", "configs/smoke.yaml", "--run-dir", str(run_dir),
           *settings(tiny_data), "--set", "train.subword_alpha=0.1", "--set", "train.max_steps=10"]
    ddp = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert ddp.stderr.count("subword sampling: epoch 1 resampled") == 1  # drawn once, by rank 0
    assert json.loads(ddp.stdout.strip().splitlines()[-1])["step"] == 10
    assert [p.name for p in (run_dir / "subword").iterdir()] == ["epoch_00001.npz"]
