"""Learning-rate schedules: values at given updates from the formulas, through torch's LambdaLR."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_cli.config import TrainConfig
from transformer_cli.errors import ConfigError
from transformer_cli.schedule import build_optimizer, build_scheduler, cycle_ends


def lrs_for(cfg: TrainConfig, updates: int, total: int = 0) -> list[float]:
    """The lr used by each of the first `updates` optimizer steps (index 0 = update 1)."""
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg)
    sched = build_scheduler(opt, cfg, total)
    out = []
    for _ in range(updates):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_inverse_sqrt_warmup_then_decay():
    cfg = TrainConfig(lr=1e-3, warmup_steps=100, schedule="inverse_sqrt")
    lrs = lrs_for(cfg, 400)
    assert lrs[0] == pytest.approx(1e-3 * 1 / 100)  # update 1: never a wasted lr=0 step
    assert lrs[49] == pytest.approx(1e-3 * 50 / 100)
    assert lrs[99] == pytest.approx(1e-3)  # peak at the end of warmup
    assert lrs[399] == pytest.approx(1e-3 * math.sqrt(100 / 400))  # halves when steps quadruple
    assert max(lrs) == pytest.approx(1e-3)


def test_constant_with_warmup():
    lrs = lrs_for(TrainConfig(lr=2e-4, warmup_steps=10, schedule="constant"), 30)
    assert lrs[4] == pytest.approx(2e-4 * 5 / 10)
    assert lrs[9:] == pytest.approx([2e-4] * 21)


def test_cosine_reaches_floor_at_total():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, schedule="cosine", min_lr=1e-4)
    lrs = lrs_for(cfg, 120, total=110)
    assert lrs[9] == pytest.approx(1e-3)
    assert lrs[59] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway
    assert lrs[109] == pytest.approx(1e-4)
    assert lrs[119] == pytest.approx(1e-4)  # held at the floor after the end


def test_cosine_needs_a_length():
    with pytest.raises(ConfigError, match="train.max_steps"):
        lrs_for(TrainConfig(schedule="cosine"), 1, total=0)


def test_optimizer_settings():
    cfg = TrainConfig(optimizer="adamw", betas=[0.8, 0.9], eps=1e-6, weight_decay=0.01)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg)
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6 and group["weight_decay"] == 0.01


def test_cosine_cycles_restart_at_the_peak_and_end_each_at_the_floor():
    """train.cycles=3 over 100 updates: warmup then cosine to the floor at 33; restarts anneal to 67 and 100."""
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, schedule="cosine", min_lr=1e-4, cycles=3)
    lrs = lrs_for(cfg, 110, total=100)
    assert cycle_ends(100, 3) == [33, 67, 100]
    assert lrs[9] == pytest.approx(1e-3)  # warmup ends in the first cycle
    for end in (33, 67, 100):
        assert lrs[end - 1] == pytest.approx(1e-4)  # each cycle's last update at the floor
    assert lrs[33] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 34)))  # update 34 restarts
    assert lrs[50] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 18 / 34)))  # update 51
    assert lrs[105] == pytest.approx(1e-4)  # held at the floor after the last cycle
    one = lrs_for(TrainConfig(lr=1e-3, warmup_steps=10, schedule="cosine", min_lr=1e-4, cycles=1), 100, total=100)
    assert one[:33] != pytest.approx(lrs[:33])  # one cycle anneals over all 100 updates
    assert one[99] == pytest.approx(1e-4)


def test_cosine_cycles_must_be_longer_than_the_warmup():
    with pytest.raises(ConfigError, match="train.cycles"):
        lrs_for(TrainConfig(schedule="cosine", warmup_steps=40, cycles=3), 1, total=100)
