"""Ensemble decoding: several trained models that share one vocabulary search as one model.

The next-token distribution is the mean of the members' probabilities (as fairseq and Sockeye
average them): log p(y) = logsumexp_m log p_m(y) - log M. `Ensemble` has the three methods the
search calls (`encode`, `decode`, `new_cache`), so greedy, beam and sampling search, the batch
invariance rules and the KV cache all work unchanged:
- `encode` concatenates the members' encoder outputs along the feature axis, so the search can
  index, copy and compact rows of one tensor; `decode` splits it again by each member's d_model;
- `new_cache` gives an `EnsembleCache`, one `KVCache` per member, reordered together.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .attention import KVCache


class EnsembleCache:
    """One KVCache per ensemble member; every reorder or reset applies to all of them."""

    def __init__(self, caches: Sequence[KVCache]):
        self.caches = list(caches)

    @property
    def length(self) -> int:
        """Number of cached decoding steps (the same for every member)."""
        return self.caches[0].length

    def reset(self) -> None:
        """Forget everything (a new batch of sentences)."""
        for cache in self.caches:
            cache.reset()

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` in every member's cache (see KVCache.reorder)."""
        for cache in self.caches:
            cache.reorder(index, cross=cross)


class Ensemble(nn.Module):
    """Models with one vocabulary, decoded by the mean of their next-token probabilities."""

    def __init__(self, models: Sequence[nn.Module]):
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model")
        vocab = {m.output.out_features for m in models}
        if len(vocab) != 1:
            raise ValueError(f"ensemble members have different target vocabularies: {sorted(vocab)}")
        self.members = nn.ModuleList(models)
        self.widths = [m.cfg.d_model for m in models]
        # the search reads cfg.max_len: every member must accept the source
        self.cfg = SimpleNamespace(max_len=min(m.cfg.max_len for m in models))

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor, need_weights: bool = False) -> torch.Tensor:
        """src (B, S) -> the members' memories side by side (B, S, sum of d_model)."""
        return torch.cat([m.encode(src, src_mask) for m in self.members], dim=-1)

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               cache: EnsembleCache | None = None, need_weights: bool = False) -> torch.Tensor:
        """tgt_in (B, T) -> log of the mean next-token probability (B, T, V), fp32.

        These are normalised log-probabilities, so the search's log_softmax leaves them as they are.
        """
        memories = memory.split(self.widths, dim=-1)  # M x (B, S, d_model of that member)
        caches = cache.caches if cache is not None else [None] * len(self.members)
        logps = [F.log_softmax(m.decode(tgt_in, mem, src_mask, cache=c, need_weights=need_weights).float(), dim=-1)
                 for m, mem, c in zip(self.members, memories, caches)]
        return torch.logsumexp(torch.stack(logps), dim=0) - math.log(len(logps))  # (B, T, V)

    def new_cache(self) -> EnsembleCache:
        """One empty KVCache per member."""
        return EnsembleCache([m.new_cache() for m in self.members])
