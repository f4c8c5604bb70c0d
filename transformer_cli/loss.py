"""Label-smoothed cross-entropy summed over non-pad target tokens (divide by the token count to report)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0,
                   pad_id: int = 0) -> torch.Tensor:
    """Sum over non-pad positions of the smoothed CE; the smoothing mass is spread over the whole vocabulary."""
    vocab = logits.size(-1)
    return F.cross_entropy(
        logits.reshape(-1, vocab),  # (B*T, V)
        labels.reshape(-1),  # (B*T,)
        ignore_index=pad_id, label_smoothing=smoothing, reduction="sum",
    )
