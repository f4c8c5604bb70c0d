"""The weights' exponential moving average: golden values of the update, the swap, and its state."""

from __future__ import annotations

import pytest
import torch

from transformer_cli.ema import EMA


def test_update_follows_the_ramped_formula_with_golden_values():
    """decay 0.9: the first updates use (1+n)/(10+n) = 0.1, 2/11, 3/12, ... until it reaches 0.9."""
    p = torch.nn.Parameter(torch.tensor([0.0, 10.0]))
    ema = EMA([p], decay=0.9)
    with torch.no_grad():
        p.copy_(torch.tensor([1.0, 0.0]))
    ema.update()  # decay 0.1: 0.1 * [0, 10] + 0.9 * [1, 0]
    assert torch.allclose(ema.shadow[0], torch.tensor([0.9, 1.0]))
    ema.update()  # decay 2/11: 2/11 * [0.9, 1] + 9/11 * [1, 0]
    assert torch.allclose(ema.shadow[0], torch.tensor([1.0 - 0.2 / 11, 2.0 / 11]))
    ema.num_updates = 1000
    assert ema.current_decay() == 0.9  # the ramp ends at the configured decay


def test_swapped_holds_the_shadow_inside_and_restores_the_weights_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema = EMA(list(model.parameters()), decay=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    trained = [p.detach().clone() for p in model.parameters()]
    with ema.swapped():
        for p, s in zip(model.parameters(), ema.shadow):
            assert torch.equal(p, s)
    for p, t, b in zip(model.parameters(), trained, before):
        assert torch.equal(p, t) and not torch.equal(p, b)


def test_state_dict_round_trip_and_refusals():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(2))
    ema = EMA([a], decay=0.99)
    ema.update()
    copy = EMA([b], decay=0.99)
    copy.load_state_dict(ema.state_dict())
    assert copy.num_updates == 1 and torch.equal(copy.shadow[0], ema.shadow[0])
    with pytest.raises(ValueError, match="holds 1 tensors, the model 2"):
        EMA([a, b], decay=0.99).load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        EMA([a], decay=1.0)
