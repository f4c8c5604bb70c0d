"""Label-smoothed cross-entropy summed over non-pad target tokens (divide by the token count to report).

Same numbers as `F.cross_entropy(logits, labels, ignore_index=pad, label_smoothing=eps,
reduction="sum")`: per token (1 - eps) * nll + eps * mean over the vocabulary of -log p. The
autograd function below writes the gradient, softmax - (1 - eps) * onehot - eps / V, into the
saved log-probabilities in place, so a step holds one (N, V) float32 buffer instead of four
(log_softmax output, nll grad, smoothing grad, their sum); with V = 8000 and 4,096-token batches
that is ~400 MB less peak memory and fewer passes over it.
"""

from __future__ import annotations

import torch


class _SmoothedCE(torch.autograd.Function):
    """Sum over rows with label != pad of the label-smoothed CE; gradient computed in place."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, smoothing: float, pad_id: int):
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # (N, V) float32 even under autocast
        keep = labels != pad_id  # (N,)
        safe = labels.masked_fill(~keep, 0).unsqueeze(1)  # (N, 1): any valid index on pad rows
        nll = -log_probs.gather(1, safe).squeeze(1)  # (N,)
        loss = (1.0 - smoothing) * nll
        if smoothing > 0:
            loss = loss - (smoothing / log_probs.shape[1]) * log_probs.sum(dim=1)
        ctx.save_for_backward(log_probs, safe, keep)
        ctx.smoothing, ctx.in_dtype = smoothing, logits.dtype
        return (loss * keep).sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        log_probs, safe, keep = ctx.saved_tensors
        eps, vocab = ctx.smoothing, log_probs.shape[1]
        grad = log_probs.exp_()  # softmax, in the saved buffer (this graph is used once)
        if eps > 0:
            grad.sub_(eps / vocab)
        grad.scatter_add_(1, safe, torch.full_like(safe, -(1.0 - eps), dtype=grad.dtype))
        grad.mul_((keep.to(grad.dtype) * grad_out).unsqueeze(1))  # pad rows get 0
        return grad.to(ctx.in_dtype), None, None, None


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0,
                   pad_id: int = 0) -> torch.Tensor:
    """Sum over non-pad positions of the smoothed CE; the smoothing mass is spread over the whole vocabulary."""
    vocab = logits.size(-1)
    return _SmoothedCE.apply(
        logits.reshape(-1, vocab),  # (B*T, V)
        labels.reshape(-1),  # (B*T,)
        float(smoothing), pad_id,
    )
