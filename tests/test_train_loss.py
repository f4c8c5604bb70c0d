"""The training loss equals torch's label-smoothed cross-entropy, in value and gradient."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from transformer_cli.loss import _RDrop, rdrop_loss_sum, token_loss_sum


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


def rdrop_reference(logits, labels, smoothing, alpha):
    """R-Drop by the formula with torch's own ops: mean CE of the two passes + alpha/4 * symmetric KL."""
    b, vocab = labels.shape[0], logits.shape[-1]
    one, two = logits[:b].reshape(-1, vocab), logits[b:].reshape(-1, vocab)  # (B*T, V) each
    y = labels.reshape(-1)
    ce = sum(F.cross_entropy(x, y, ignore_index=0, label_smoothing=smoothing, reduction="none") for x in (one, two))
    lp1, lp2 = F.log_softmax(one, -1), F.log_softmax(two, -1)
    sym_kl = (F.kl_div(lp2, lp1, log_target=True, reduction="none")
              + F.kl_div(lp1, lp2, log_target=True, reduction="none")).sum(-1)  # KL(p1||p2) + KL(p2||p1)
    return ((0.5 * ce + 0.25 * alpha * sym_kl) * (y != 0)).sum()


@pytest.mark.parametrize("rows", [3, 64])  # blocks that split rows unevenly, and one block for all
@pytest.mark.parametrize("smoothing,alpha", [(0.0, 1.0), (0.1, 3.0), (0.1, 0.0)])
def test_rdrop_matches_the_formula(monkeypatch, rows, smoothing, alpha):
    monkeypatch.setattr(_RDrop, "ROWS", rows)
    one, labels = sample(2)
    two, _ = sample(3)  # the second "dropout pass": other logits for the same labels
    logits = torch.cat([one, two]).detach().requires_grad_()  # (2B, T, V)
    ours = rdrop_loss_sum(logits, labels, smoothing, alpha)
    (g_ours,) = torch.autograd.grad(2.5 * ours, logits)
    ref = rdrop_reference(logits, labels, smoothing, alpha)
    (g_ref,) = torch.autograd.grad(2.5 * ref, logits)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(g_ours, g_ref, atol=1e-5)
    assert g_ours[0, 5:].abs().max() == 0 and g_ours[4, 5:].abs().max() == 0  # pads of both passes


def test_rdrop_of_identical_passes_is_the_cross_entropy():
    logits, labels = sample(4)
    twice = torch.cat([logits, logits]).detach().requires_grad_()
    loss = rdrop_loss_sum(twice, labels, 0.1, alpha=5.0)  # KL of a distribution with itself is 0
    (grad,) = torch.autograd.grad(loss, twice)
    ref = token_loss_sum(logits, labels, 0.1)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(grad[:4] + grad[4:], g_ref, atol=1e-6)
