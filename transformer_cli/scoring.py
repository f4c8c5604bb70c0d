"""Forced decoding: the log-probability a model gives a known target for a source.

`tcli score` and scripts/rerank.py use it: perplexity of a reference set, filtering noisy pairs,
reranking an n-best list with a reverse-direction model. A score is log P(target + EOS | source),
natural log, summed over the target's subwords and the EOS, teacher-forced in one decoder pass per
batch, without label smoothing. An Ensemble scores with the mean of its members' probabilities.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .search import inference, model_max_len, pad_sources, prepare_sources
from .tokenizer import BOS_ID, EOS_ID, PAD_ID


def score_batches(src_lens: Sequence[int], tgt_lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Index lists of similar-length pairs, each at most max_tokens padded tokens on its longer side."""
    order = sorted(range(len(src_lens)), key=lambda i: (src_lens[i], tgt_lens[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        side = max(src_lens[i], tgt_lens[i])
        if current and (len(current) + 1) * max(longest, side) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, side)
    if current:
        batches.append(current)
    return batches


def _target_tensors(tgts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bare target ids to decoder inputs (BOS + y) and labels (y + EOS), both (B, T), padded at the end."""
    T = max(len(t) for t in tgts) + 1
    tgt_in = torch.full((len(tgts), T), PAD_ID, dtype=torch.long)
    labels = torch.full((len(tgts), T), PAD_ID, dtype=torch.long)
    for row, t in enumerate(tgts):
        tgt_in[row, : len(t) + 1] = torch.as_tensor([BOS_ID, *t], dtype=torch.long)
        labels[row, : len(t) + 1] = torch.as_tensor([*t, EOS_ID], dtype=torch.long)
    return tgt_in.to(device), labels.to(device)


def score_ids(model, srcs: Sequence[Sequence[int]], tgts: Sequence[Sequence[int]], device,
              precision: str = "fp32", max_tokens: int = 8000, progress: bool = False) -> list[float]:
    """log P(tgt + EOS | src) of bare source/target id lists (no specials), in input order.

    Sources longer than the model's max_len are cut as decoding cuts them; targets are scored whole.
    """
    if len(srcs) != len(tgts):
        raise ValueError(f"{len(srcs)} sources but {len(tgts)} targets")
    device = torch.device(device)
    inputs = prepare_sources(srcs, model_max_len(model))
    scores = [0.0] * len(inputs)
    with inference(model, device, precision, len(inputs), progress) as bar:
        for batch in score_batches([len(s) for s in inputs], [len(t) + 1 for t in tgts], max_tokens):
            src, src_mask = pad_sources([inputs[i] for i in batch], device)  # (B, S)
            tgt_in, labels = _target_tensors([tgts[i] for i in batch], device)  # (B, T)
            memory = model.encode(src, src_mask)
            logits = model.decode(tgt_in, memory, src_mask).float()  # (B, T, V)
            # log_softmax at the labels only, without a second (B, T, V) tensor; an Ensemble's output
            # is already normalised (its logsumexp is 0)
            picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (B, T)
            sums = picked.masked_fill(labels == PAD_ID, 0.0).sum(dim=-1)  # (B,)
            for i, value in zip(batch, sums.tolist()):
                scores[i] = value
            bar.update(len(batch))
    return scores
