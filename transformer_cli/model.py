"""The encoder-decoder Transformer (Vaswani et al., 2017): embeddings, positions, blocks, model.

Post-LN (the paper) or Pre-LN (LayerNorm before each sub-layer, one final LayerNorm after each
stack). Block parameters are named as in torch.nn.TransformerEncoderLayer/DecoderLayer
(`self_attn`, `linear1`, `linear2`, `norm1`..), so weights compare one to one with them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import KVCache, MultiHeadAttention
from .config import Config, ModelConfig
from .tokenizer import PAD_ID


class SinusoidalPositions(nn.Module):
    """P[pos, 2i] = sin(pos / 10000^(2i/d)), P[pos, 2i+1] = cos(pos / 10000^(2i/d)), for any pos."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model
        self._tables: dict = {}  # (device, dtype) -> table; grown on demand, so never a length limit

    def _build(self, size: int) -> torch.Tensor:
        """The first `size` rows, computed in float64 (exact enough for long positions)."""
        pos = torch.arange(size, dtype=torch.float64).unsqueeze(1)  # (size, 1)
        inv_freq = 10000.0 ** (-torch.arange(0, self.d_model, 2, dtype=torch.float64) / self.d_model)
        angles = pos * inv_freq  # (size, ceil(d/2))
        table = torch.empty(size, self.d_model, dtype=torch.float64)
        table[:, 0::2] = torch.sin(angles)
        table[:, 1::2] = torch.cos(angles[:, : self.d_model // 2])
        return table

    def forward(self, length: int, offset: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
        """Encodings of positions offset .. offset + length - 1: (length, d_model)."""
        key = (torch.device(device or "cpu"), dtype)
        table = self._tables.get(key)
        if table is None or table.shape[0] < offset + length:
            size = max(offset + length, 2 * (0 if table is None else table.shape[0]), 256)
            # a plain tensor even when first asked for under inference_mode, so training can reuse it
            with torch.inference_mode(False), torch.no_grad():
                self._tables[key] = table = self._build(size).to(device=key[0], dtype=dtype)
        return table[offset : offset + length]


class Dropout(nn.Module):
    """Inverted dropout, x * mask / keep; on CPU the mask comes from 16 random bits per element.

    Why: CPU `bernoulli_` draws one float per element serially and was ~21 % of a bf16 training
    step; slicing int64 draws into four int16 lanes makes the whole dropout (forward + backward)
    3.3-3.4x faster (scripts/bench_dropout.py). The drop probability is rounded to a multiple of 2**-16 and
    `keep` is that rounded value's complement, so E[output] = x exactly. Uses torch's global
    generator, so seeding and exact resume work as with nn.Dropout. CUDA keeps F.dropout (fused).
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        drop = round(self.p * 65536)  # P(drop) = drop / 2**16
        if x.device.type != "cpu" or not 0 < drop < 65536:
            return F.dropout(x, self.p, True)
        n = x.numel()
        draws = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64)  # (ceil(n/4),)
        bits = draws.view(torch.int16)[:n].view(x.shape)  # uniform over int16, one per element
        keep_mask = bits >= drop - 32768
        return x * keep_mask * (65536 / (65536 - drop))

    def extra_repr(self) -> str:
        return f"p={self.p}"


def _add_sublayers(block: nn.Module, cfg: ModelConfig, num_norms: int) -> None:
    """Give a block what encoder and decoder blocks share: self-attention, FFN, norms, dropout."""
    block.norm_first = cfg.norm == "pre"
    block.self_attn = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)
    block.linear1 = nn.Linear(cfg.d_model, cfg.ff_size)
    block.linear2 = nn.Linear(cfg.ff_size, cfg.d_model)
    block.activation = F.gelu if cfg.activation == "gelu" else F.relu
    for i in range(1, num_norms + 1):
        setattr(block, f"norm{i}", nn.LayerNorm(cfg.d_model))
    block.dropout = Dropout(cfg.dropout)


def _ffn(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Position-wise feed-forward network of a block: linear2(activation(linear1(x)))."""
    return block.linear2(block.activation(block.linear1(x)))


def _residual(block: nn.Module, x: torch.Tensor, norm: nn.LayerNorm, fn) -> torch.Tensor:
    """Sub-layer fn with dropout and residual: Post-LN norm(x + fn(x)) or Pre-LN x + fn(norm(x))."""
    if block.norm_first:
        return x + block.dropout(fn(norm(x)))
    return norm(x + block.dropout(fn(x)))


class EncoderLayer(nn.Module):
    """Self-attention and FFN, each with dropout, residual and LayerNorm (post or pre)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _add_sublayers(self, cfg, num_norms=2)

    def forward(self, x, mask, need_weights=False):
        """x (B, S, d_model), mask bool (B, 1, 1, S) -> (x, weights or None)."""
        w = {}

        def self_block(h):
            out, w["self"] = self.self_attn(h, h, h, mask=mask, need_weights=need_weights)
            return out

        x = _residual(self, x, self.norm1, self_block)
        x = _residual(self, x, self.norm2, lambda h: _ffn(self, h))
        return x, w["self"]


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output and FFN, each with residual + LayerNorm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _add_sublayers(self, cfg, num_norms=3)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention_dropout)

    def forward(self, x, memory, memory_mask, cache=None, layer=None, need_weights=False):
        """x (B, T, d_model), memory (B, S, d_model), memory_mask (B, 1, 1, S) -> (x, self_w, cross_w)."""
        w = {}

        def self_block(h):
            out, w["self"] = self.self_attn(
                h, h, h, need_weights=need_weights, cache=cache, layer=layer, kind="self", causal=True
            )
            return out

        def cross_block(h):
            out, w["cross"] = self.cross_attn(
                h, memory, memory, mask=memory_mask, need_weights=need_weights, cache=cache, layer=layer, kind="cross"
            )
            return out

        x = _residual(self, x, self.norm1, self_block)
        x = _residual(self, x, self.norm2, cross_block)
        x = _residual(self, x, self.norm3, lambda h: _ffn(self, h))
        return x, w["self"], w["cross"]


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer returning next-token logits."""

    def __init__(self, cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int, pad_id: int = PAD_ID):
        super().__init__()
        self.cfg, self.pad_id, self.d_model = cfg, pad_id, cfg.d_model
        self.src_embed = nn.Embedding(src_vocab_size, cfg.d_model, padding_idx=pad_id)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, cfg.d_model, padding_idx=pad_id)
        self.output = nn.Linear(cfg.d_model, tgt_vocab_size, bias=False)
        self.positions = SinusoidalPositions(cfg.d_model)
        self.embed_scale = math.sqrt(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.decoder_layers)])
        # Pre-LN leaves the residual stream un-normalised: one LayerNorm closes each stack.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self._reset_parameters()
        # Tied embeddings (Press & Wolf 2017): the output projection always shares the target
        # embedding when asked; the source shares it too when the vocabulary is joint (same size).
        self.tied = cfg.tie_embeddings
        if cfg.tie_embeddings:
            self.output.weight = self.tgt_embed.weight
            if src_vocab_size == tgt_vocab_size:
                self.src_embed.weight = self.tgt_embed.weight
        self._weights: dict[str, list[torch.Tensor]] = {"encoder": [], "decoder_self": [], "cross": []}

    def _reset_parameters(self) -> None:
        """Xavier-uniform for every linear map, zero biases (paper reference code, fairseq).

        Embeddings: normal with std d_model**-0.5 (fairseq), so that after the sqrt(d_model)
        scaling the token vectors have unit variance, the same scale as the positions; pad row zero.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MultiHeadAttention):
                module.reset_parameters()
        for emb in (self.src_embed, self.tgt_embed):
            nn.init.normal_(emb.weight, mean=0.0, std=self.d_model**-0.5)
            with torch.no_grad():
                emb.weight[self.pad_id].zero_()

    def _embed(self, embedding: nn.Embedding, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Token embedding * sqrt(d_model) + sinusoidal position, then dropout: (B, T, d_model)."""
        x = embedding(ids) * self.embed_scale
        if self.training and self.cfg.word_dropout > 0:
            # Word dropout (Sennrich & Zhang 2019): a dropped token keeps only its position, so the
            # model must fill it in from context. Not rescaled: a token is there or it is not.
            keep = torch.rand(ids.shape, device=ids.device) >= self.cfg.word_dropout  # (B, T)
            x = x * keep.unsqueeze(-1).to(x.dtype)  # (B, T, d_model)
        x = x + self.positions(ids.shape[1], offset, device=x.device, dtype=x.dtype)
        return self.dropout(x)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor, need_weights: bool = False) -> torch.Tensor:
        """src (B, S) ids, src_mask bool (B, S) True = real token -> memory (B, S, d_model)."""
        mask = src_mask[:, None, None, :]  # (B, 1, 1, S): the same keys for every head and query
        x = self._embed(self.src_embed, src)
        weights = []
        for layer in self.encoder:
            x, w = layer(x, mask, need_weights)
            weights.append(w)
        if need_weights:
            self._weights["encoder"] = weights
        return self.encoder_norm(x)

    def decode(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor:
        """tgt_in (B, T) ids -> logits (B, T, V). With a cache, tgt_in is only the new tokens.

        Target padding must sit at the end of each row (as batching builds it): with the causal
        mask a real position then never sees a pad, so no target padding mask is needed.
        """
        offset = cache.length if cache is not None else 0
        mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
        x = self._embed(self.tgt_embed, tgt_in, offset)
        self_w, cross_w = [], []
        for i, layer in enumerate(self.decoder):
            x, sw, cw = layer(x, memory, mask, cache=cache, layer=i, need_weights=need_weights)
            self_w.append(sw)
            cross_w.append(cw)
        if need_weights:
            self._weights["decoder_self"], self._weights["cross"] = self_w, cross_w
        return self.output(self.decoder_norm(x))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, T, V); padding masks from pad_id, causal mask inside the decoder."""
        src_mask = src != self.pad_id  # (B, S)
        memory = self.encode(src, src_mask)
        return self.decode(tgt_in, memory, src_mask)

    def new_cache(self) -> KVCache:
        """An empty key/value cache for incremental decoding with this model."""
        return KVCache(len(self.decoder))

    def attention_weights(self) -> dict[str, list[torch.Tensor]]:
        """Per-layer (B, H, Tq, Tk) weights ("encoder", "decoder_self", "cross") of the last need_weights call."""
        return self._weights


def build_model(cfg: Config, src_vocab_size: int, tgt_vocab_size: int) -> Seq2SeqTransformer:
    """The model described by cfg.model for the given vocabulary sizes."""
    return Seq2SeqTransformer(cfg.model, src_vocab_size, tgt_vocab_size, pad_id=PAD_ID)
