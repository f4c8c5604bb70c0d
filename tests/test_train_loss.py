"""The training loss equals torch's label-smoothed cross-entropy, in value and gradient."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from transformer_cli.loss import token_loss_sum


def sample(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(4, 7, 11, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(1, 11, (4, 7), generator=g)
    labels[0, 5:] = 0  # padding at the end of two rows
    labels[2, 3:] = 0
    return logits, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_matches_torch_cross_entropy(smoothing):
    logits, labels = sample()
    ours = token_loss_sum(logits, labels, smoothing)
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=0,
                          label_smoothing=smoothing, reduction="sum")
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(g_ours, g_ref, atol=1e-6)
    assert g_ours[0, 5:].abs().max() == 0  # pad positions get no gradient


def test_formula_on_one_token():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    p = torch.softmax(logits, -1)[0]
    eps = 0.2
    expect = -(1 - eps) * math.log(p[2]) - eps / 4 * sum(math.log(x) for x in p)
    assert token_loss_sum(logits, torch.tensor([2]), eps, pad_id=0).item() == pytest.approx(expect, rel=1e-6)


def test_bf16_logits_get_bf16_gradients_close_to_fp32():
    logits, labels = sample(1)
    low = logits.detach().bfloat16().requires_grad_()
    loss = token_loss_sum(low, labels, 0.1)
    loss.backward()
    ref = token_loss_sum(low.detach().float(), labels, 0.1)
    assert loss.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)  # computed in float32 from the same values
