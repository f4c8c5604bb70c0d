"""The attention core: masks, masked softmax, additive / dot-product / multi-head attention, KV cache.

The formulas of the course notes are the specification. One mask convention everywhere: a
`torch.bool` tensor, True = may attend, broadcastable to the scores (B, H, Tq, Tk). No model code
lives here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def sequence_mask(valid_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Bool (*valid_lens.shape, max_len), True where position < valid length."""
    positions = torch.arange(max_len, device=valid_lens.device)
    return positions < valid_lens.unsqueeze(-1)


def causal_mask(size: int, device: torch.device | str | None = None, offset: int = 0) -> torch.Tensor:
    """Bool (size, size + offset): query i (at absolute position offset + i) may attend to keys j <= offset + i."""
    query_pos = torch.arange(size, device=device).unsqueeze(1) + offset
    key_pos = torch.arange(size + offset, device=device).unsqueeze(0)
    return key_pos <= query_pos


def _valid_lens_mask(valid_lens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Turn valid_lens (B,) or (B, Tq) into a bool mask broadcastable to scores (B, ..., Tq, Tk)."""
    mask = sequence_mask(valid_lens.to(scores.device), scores.shape[-1])  # (B, Tk) or (B, Tq, Tk)
    if valid_lens.dim() == 1:
        mask = mask.unsqueeze(-2)  # (B, 1, Tk): same keys for every query row
    # insert singleton axes between the batch axis and (Tq, Tk), e.g. for heads
    return mask.view(mask.shape[0], *([1] * (scores.dim() - 3)), *mask.shape[1:])  # (B, 1.., Tq|1, Tk)


def masked_softmax(
    scores: torch.Tensor, valid_lens: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax over the last axis; masked entries are exactly 0 and a row with no valid entry is all 0."""
    if valid_lens is not None:
        lens_mask = _valid_lens_mask(valid_lens, scores)
        mask = lens_mask if mask is None else mask & lens_mask
    if mask is None:
        return F.softmax(scores, dim=-1)
    # A finite fill (not -inf) keeps fully masked rows finite (uniform) in every dtype, so the
    # forward and the gradients never see NaN; multiplying by the mask then zeroes those rows.
    filled = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return F.softmax(filled, dim=-1) * mask


class DotProductAttention(nn.Module):
    """Scaled dot-product attention: softmax(Q K^T / sqrt(d_k)) V."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.attention_weights: torch.Tensor | None = None

    def forward(self, queries, keys, values, valid_lens=None, mask=None):
        """queries (B, Tq, d), keys (B, Tk, d), values (B, Tk, dv) -> (B, Tq, dv)."""
        scores = queries @ keys.transpose(-2, -1) / math.sqrt(queries.shape[-1])  # (B, Tq, Tk)
        self.attention_weights = masked_softmax(scores, valid_lens, mask)
        return self.dropout(self.attention_weights) @ values


class AdditiveAttention(nn.Module):
    """Additive (Bahdanau) attention: score v^T tanh(W_q q + W_k k)."""

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0):
        super().__init__()
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights: torch.Tensor | None = None

    def forward(self, queries, keys, values, valid_lens=None, mask=None):
        """queries (B, Tq, q_size), keys (B, Tk, k_size), values (B, Tk, dv) -> (B, Tq, dv)."""
        # every query against every key by broadcasting: (B, Tq, 1, h) + (B, 1, Tk, h)
        features = torch.tanh(self.W_q(queries).unsqueeze(2) + self.W_k(keys).unsqueeze(1))  # (B, Tq, Tk, h)
        scores = self.w_v(features).squeeze(-1)  # (B, Tq, Tk)
        self.attention_weights = masked_softmax(scores, valid_lens, mask)
        return self.dropout(self.attention_weights) @ values


def kernel_regression(queries, keys, values, bandwidth: float = 1.0):
    """Nadaraya-Watson regression with a Gaussian kernel; returns (predictions, weights (Nq, Nk)).

    queries (Nq,) or (Nq, d); keys (Nk,) or (Nk, d); values (Nk,) or (Nk, dv). The weight of key j
    for query i is softmax_j(-||q_i - k_j||^2 / (2 bandwidth^2)): no learned parameters.
    """
    q = queries.unsqueeze(-1) if queries.dim() == 1 else queries  # (Nq, d)
    k = keys.unsqueeze(-1) if keys.dim() == 1 else keys  # (Nk, d)
    sq_dist = ((q.unsqueeze(1) - k.unsqueeze(0)) ** 2).sum(-1)  # (Nq, Nk)
    weights = F.softmax(-sq_dist / (2 * bandwidth**2), dim=-1)
    return weights @ values, weights


class KVCache:
    """Keys and values of earlier decoding steps, per decoder layer, for incremental decoding.

    Self-attention keys/values (B, H, t, D) are appended at every step; cross-attention
    keys/values are projected from the encoder output once per sentence and kept.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.reset()

    def reset(self) -> None:
        """Forget everything (a new batch of sentences)."""
        self.self_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self.cross_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers

    @property
    def length(self) -> int:
        """Number of cached decoding steps (the position of the next token)."""
        kv = self.self_kv[0]
        return 0 if kv is None else kv[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new (B, H, t, D) keys/values of `layer` along time; return all of them."""
        old = self.self_kv[layer]
        if old is not None:
            k = torch.cat([old[0], k], dim=2)  # (B, H, T_old + t, D)
            v = torch.cat([old[1], v], dim=2)  # (B, H, T_old + t, D)
        self.self_kv[layer] = (k, v)
        return k, v

    def get_cross(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The encoder keys/values of `layer`, or None before the first step."""
        return self.cross_kv[layer]

    def set_cross(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the encoder keys/values (B, H, S, D) of `layer` for the rest of the sentence."""
        self.cross_kv[layer] = (k, v)

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` (beam reordering or dropping finished sentences) in every layer.

        `cross=False` skips the encoder keys/values: valid when rows of the same sentence share
        one source (beams copied from one memory) and the batch size does not change.
        """
        def select(kv):
            return None if kv is None else (kv[0].index_select(0, index), kv[1].index_select(0, index))

        self.self_kv = [select(kv) for kv in self.self_kv]
        if cross:
            self.cross_kv = [select(kv) for kv in self.cross_kv]


class MultiHeadAttention(nn.Module):
    """Multi-head attention: per-head projections, heads in parallel, concatenation, W^O.

    Parameters use torch.nn.MultiheadAttention's layout (`in_proj_weight` (3 d_model, d_model)
    holding W^Q, W^K, W^V stacked; `out_proj`), so weights load from and compare with it, and
    self-attention projects Q, K and V with one matmul.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.dropout = dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * d_model)) if bias else None
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform on the stacked (3d, d) matrix (= per-matrix Xavier with gain 1/sqrt(2), as fairseq)."""
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _project(self, x: torch.Tensor, part: slice) -> torch.Tensor:
        """Apply the rows `part` of the stacked input projection to x (B, T, d_model)."""
        bias = None if self.in_proj_bias is None else self.in_proj_bias[part]
        return F.linear(x, self.in_proj_weight[part], bias)

    def _split_heads(self, x: torch.Tensor, n: int) -> list[torch.Tensor]:
        """(B, T, n * d_model) -> n tensors (B, H, T, D)."""
        B, T, _ = x.shape
        x = x.view(B, T, n, self.num_heads, self.head_dim)  # (B, T, n, H, D)
        return list(x.permute(2, 0, 3, 1, 4).unbind(0))  # n x (B, H, T, D)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        layer: int | None = None,
        kind: str | None = None,
        causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from query (B, Tq, d) to key/value (B, Tk, d); returns (output (B, Tq, d), weights or None).

        mask: bool, True = may attend, broadcastable to (B, H, Tq, Tk). causal: add the causal mask
        (aligned so the last query sees every key, which is what decoding with a cache needs).
        need_weights: take the explicit path and return the (B, H, Tq, Tk) weights.
        cache/layer/kind: with a KVCache, kind "self" appends this step's keys/values to the cache
        and attends to all of them; kind "cross" projects `key`/`value` once and reuses them.
        """
        d = self.d_model
        kind = kind or ("self" if query is key and key is value else "cross")
        if kind == "self" and query is key and key is value:
            q, k, v = self._split_heads(self._project(query, slice(0, 3 * d)), 3)  # one fused matmul
        else:
            (q,) = self._split_heads(self._project(query, slice(0, d)), 1)
            cached = cache.get_cross(layer) if cache is not None and kind == "cross" else None
            if cached is not None:
                k, v = cached
            elif key is value:
                k, v = self._split_heads(self._project(key, slice(d, 3 * d)), 2)
            else:
                (k,) = self._split_heads(self._project(key, slice(d, 2 * d)), 1)
                (v,) = self._split_heads(self._project(value, slice(2 * d, 3 * d)), 1)
            if cache is not None and kind == "cross" and cached is None:
                cache.set_cross(layer, k, v)
        if cache is not None and kind == "self":
            k, v = cache.update(layer, k, v)

        out, weights = self.attend(q, k, v, mask, causal, need_weights)  # (B, H, Tq, D)
        B, H, Tq, D = out.shape
        out = out.transpose(1, 2).reshape(B, Tq, H * D)  # (B, Tq, d_model): concatenated heads
        return self.out_proj(out), weights

    def attend(self, q, k, v, mask=None, causal=False, need_weights=False):
        """Per-head attention on (B, H, T, D) tensors; returns (output (B, H, Tq, D), weights or None)."""
        Tq, Tk = q.shape[2], k.shape[2]
        dropout_p = self.dropout if self.training else 0.0
        # CPU bf16 training: SDPA's CPU backward is slower than two bf16 matmuls at translation
        # lengths (scripts/bench_bf16_attention_path.py: 0.83x of the step time), so take the
        # explicit path there too; it gives the same numbers.
        explicit = need_weights or (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.requires_grad)
        is_causal = False
        if causal and Tq > 1:
            if mask is None and Tq == Tk and not explicit:
                is_causal = True  # SDPA's own causal kernel: no mask tensor at all
            else:
                cm = causal_mask(Tq, q.device, offset=Tk - Tq)  # (Tq, Tk)
                mask = cm if mask is None else mask & cm
        # (a single query at the end of the cache may see every key: no causal mask needed)

        # A query row with no key to attend to must give zeros. The check reduces the mask only (no
        # H, no D axis): for padding masks (B, 1, 1, Tk) it is nearly free. On CPU the branch is
        # free too, so the common case (no empty row) pays for nothing more; on other devices (the
        # branch would wait for the device) and under torch.compile we always take the safe route.
        empty_rows = None
        if mask is not None:
            has_key = mask.any(dim=-1, keepdim=True)  # (..., Tq, 1)
            if q.device.type != "cpu" or torch.compiler.is_compiling() or not bool(has_key.all()):
                empty_rows = ~has_key

        if explicit:  # explicit path: the same numbers, plus the weights for plots
            scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
            if mask is not None:
                # in place on our own scores; exp(finfo.min - max) is exactly 0 in every dtype, so
                # masked entries of a row with at least one key get exactly 0 without a multiply
                scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
            weights = F.softmax(scores, dim=-1)
            if empty_rows is not None:
                weights = weights.masked_fill(empty_rows, 0.0)  # those rows came out uniform
            out = (F.dropout(weights, dropout_p) if dropout_p > 0 else weights) @ v  # (B, H, Tq, D)
            return out, (weights if need_weights else None)

        if empty_rows is not None:
            # SDPA may return NaN for such rows (backend dependent): let them attend everywhere,
            # then zero them.
            mask = mask | empty_rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        if empty_rows is not None:
            out = out.masked_fill(empty_rows, 0.0)  # (B, H, Tq, D)
        return out, None
