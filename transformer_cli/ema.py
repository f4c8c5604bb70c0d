"""Exponential moving average (EMA) of the weights, kept beside training and saved as `checkpoints/ema`.

After every update: shadow <- decay * shadow + (1 - decay) * weights, with the decay ramped as
min(decay, (1 + n) / (10 + n)) over the first updates so the random initialisation fades quickly
(the warm-up of TensorFlow's ExponentialMovingAverage). A continuous cousin of checkpoint averaging.
"""

from __future__ import annotations

import contextlib

import torch


class EMA:
    """The shadow weights of a list of parameters; explicit `update`, `state_dict` and `swapped`."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.params, self.decay = list(params), decay
        # fp32 shadows even if the weights are lower precision: 1 - decay is tiny
        self.shadow = [p.detach().float().clone() for p in self.params]
        self.num_updates = 0

    def current_decay(self) -> float:
        """The decay this update uses: ramped up from 0.1 so early shadows are not the initialisation."""
        return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))

    @torch.no_grad()
    def update(self) -> None:
        """Move the shadows towards the current weights (call after each optimizer step)."""
        weight = 1.0 - self.current_decay()
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], weight)
        self.num_updates += 1

    @contextlib.contextmanager
    def swapped(self):
        """Inside the block the parameters hold the shadow weights (to save or evaluate them)."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates, "shadow": [s.clone() for s in self.shadow]}  # decay: the config's

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state holds {len(state['shadow'])} tensors, the model {len(self.shadow)}")
        self.num_updates = int(state["num_updates"])
        for s, saved in zip(self.shadow, state["shadow"]):
            s.copy_(saved)
