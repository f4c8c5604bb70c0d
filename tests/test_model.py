"""The encoder-decoder Transformer against torch.nn layers and the properties it must have."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from transformer_cli.attention import causal_mask, sequence_mask
from transformer_cli.config import Config, ModelConfig
from transformer_cli.model import DecoderLayer, Dropout, EncoderLayer, SinusoidalPositions, build_model

D, H, FF = 16, 4, 32


def _cfg(**kw) -> ModelConfig:
    base = dict(d_model=D, num_heads=H, ff_size=FF, encoder_layers=2, decoder_layers=2, dropout=0.0)
    return ModelConfig(**{**base, **kw})


def _model(vocab=30, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = Config(model=_cfg(**kw))
    return build_model(cfg, vocab, vocab).eval()


def _randomise(module: torch.nn.Module) -> None:
    """Non-trivial values everywhere (biases and LayerNorm too) so that any misplaced term shows."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)


def _src_batch(vocab=30, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (3, 7), generator=g)
    src[1, 5:] = 0  # padding at the end, as batching builds it
    src[2, 2:] = 0
    tgt = torch.randint(4, vocab, (3, 6), generator=g)
    return src, tgt


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_equals_torch(norm, activation):
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=activation,
                                           batch_first=True, norm_first=norm == "pre")
    _randomise(ref)
    ours = EncoderLayer(_cfg(norm=norm, activation=activation))
    ours.load_state_dict(ref.state_dict())  # same names: self_attn, linear1/2, norm1/2
    x = torch.randn(2, 5, D)
    keep = sequence_mask(torch.tensor([5, 3]), 5)
    expect = ref(x, src_key_padding_mask=~keep)
    out, _ = ours(x, keep[:, None, None, :])
    assert torch.allclose(out, expect, atol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_layer_equals_torch(norm):
    torch.manual_seed(1)
    ref = torch.nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm == "pre")
    _randomise(ref)
    ours = DecoderLayer(_cfg(norm=norm))
    state = {k.replace("multihead_attn.", "cross_attn."): v for k, v in ref.state_dict().items()}
    ours.load_state_dict(state)
    x, mem = torch.randn(2, 4, D), torch.randn(2, 6, D)
    keep = sequence_mask(torch.tensor([6, 2]), 6)
    expect = ref(x, mem, tgt_mask=~causal_mask(4), memory_key_padding_mask=~keep)
    out, _, _ = ours(x, mem, keep[:, None, None, :])
    assert torch.allclose(out, expect, atol=1e-5)


def test_encoder_self_attention_without_positions_is_permutation_equivariant():
    torch.manual_seed(2)
    layer = EncoderLayer(_cfg()).eval()
    x, perm = torch.randn(2, 6, D), torch.randperm(6)
    all_real = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    out, _ = layer(x, all_real)
    out_perm, _ = layer(x[:, perm], all_real)
    assert torch.allclose(out_perm, out[:, perm], atol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_is_causal(norm):
    model = _model(norm=norm)
    src, tgt = _src_batch()
    logits = model(src, tgt)
    for i in (0, 3):
        changed = tgt.clone()
        changed[:, i + 1:] = torch.randint(4, 30, changed[:, i + 1:].shape)
        assert not torch.equal(changed, tgt)
        out = model(src, changed)
        assert torch.allclose(out[:, : i + 1], logits[:, : i + 1], atol=1e-5)
        assert not torch.allclose(out[:, i + 1:], logits[:, i + 1:], atol=1e-3)  # later ones do change


def test_extra_source_padding_changes_nothing():
    model = _model(norm="pre")
    src, tgt = _src_batch()
    padded = torch.cat([src, torch.zeros(3, 4, dtype=src.dtype)], dim=1)  # (B, S + 4)
    mem = model.encode(src, src != 0)
    mem_padded = model.encode(padded, padded != 0)
    real = src != 0
    assert torch.allclose(mem_padded[:, :7][real], mem[real], atol=1e-5)
    assert torch.allclose(model(padded, tgt), model(src, tgt), atol=1e-5)


def test_decode_weights_are_exposed_and_ignore_source_pads():
    model = _model()
    src, tgt = _src_batch()
    mem = model.encode(src, src != 0, need_weights=True)
    logits = model.decode(tgt, mem, src != 0, need_weights=True)
    assert torch.allclose(logits, model(src, tgt), atol=1e-5)  # the explicit path gives the same numbers
    w = model.attention_weights()
    assert [t.shape for t in w["encoder"]] == [(3, H, 7, 7)] * 2
    assert [t.shape for t in w["decoder_self"]] == [(3, H, 6, 6)] * 2
    assert [t.shape for t in w["cross"]] == [(3, H, 6, 7)] * 2
    for cross in w["cross"]:
        assert (cross[2, :, :, 2:] == 0).all()
        assert torch.allclose(cross.sum(-1), torch.ones(3, H, 6), atol=1e-5)
    assert (w["decoder_self"][0][..., ~causal_mask(6)] == 0).all()


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_incremental_decoding_equals_full_decoding(norm):
    model = _model(norm=norm, seed=3)
    src, tgt = _src_batch()
    src_mask = src != 0
    full = model(src, tgt)
    mem = model.encode(src, src_mask)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t: t + 1], mem, src_mask, cache=cache) for t in range(3)]
    steps.append(model.decode(tgt[:, 3:], mem, src_mask, cache=cache))  # several new tokens at once
    assert cache.length == 6
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_incremental_decoding_after_beam_reorder():
    model = _model(seed=4)
    src, _ = _src_batch()
    beam = 2
    src = src.repeat_interleave(beam, 0)  # (B * beam, S): beams of one sentence share its source
    src_mask = src != 0
    mem = model.encode(src, src_mask)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(4, 30, (src.shape[0], 1), generator=g)
    cache = model.new_cache()
    for step in range(5):
        logits = model.decode(tokens[:, -1:], mem, src_mask, cache=cache)
        full = model.decode(tokens, mem, src_mask)
        assert torch.allclose(logits[:, 0], full[:, -1], atol=1e-5)
        n = tokens.shape[0]
        if step != 2:  # reorder within each sentence's beams; cross keys/values stay valid
            index = torch.arange(0, n, beam).repeat_interleave(beam)  # first beam of each row's sentence
            index = index + torch.randint(0, beam, (n,), generator=g)
            cache.reorder(index, cross=False)
        else:  # drop the middle sentence and swap the others: sources move too
            index = torch.tensor([4, 5, 0, 0])
            cache.reorder(index)
            mem, src_mask = mem[index], src_mask[index]
        assert not torch.equal(index, torch.arange(n))
        tokens = torch.cat([tokens[index], torch.randint(4, 30, (len(index), 1), generator=g)], 1)


def test_positions_beyond_training_length():
    model = _model(seed=6)
    src, _ = _src_batch()
    long_tgt = torch.randint(4, 30, (3, 300))  # longer than model.max_len (256)
    logits = model(src, long_tgt)
    assert logits.shape == (3, 300, 30) and torch.isfinite(logits).all()
    mem = model.encode(src, src != 0)
    cache = model.new_cache()
    model.decode(long_tgt[:, :299], mem, src != 0, cache=cache)
    last = model.decode(long_tgt[:, 299:], mem, src != 0, cache=cache)
    assert torch.allclose(last[:, 0], logits[:, -1], atol=1e-4)


def test_sinusoidal_encoding_formula_and_rotation():
    d = 10
    pe = SinusoidalPositions(d)
    table = pe(50, device="cpu", dtype=torch.float64)
    pos = torch.arange(50, dtype=torch.float64)
    for i in range(d // 2):
        freq = 1 / 10000 ** (2 * i / d)
        assert torch.allclose(table[:, 2 * i], torch.sin(pos * freq), atol=1e-12)
        assert torch.allclose(table[:, 2 * i + 1], torch.cos(pos * freq), atol=1e-12)
        for k in (1, 7):
            # [sin, cos] at pos + k is a fixed rotation (depending on k only) of [sin, cos] at pos
            c, s = torch.cos(torch.tensor(k * freq)), torch.sin(torch.tensor(k * freq))
            rot = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
            pair = table[:, 2 * i: 2 * i + 2]  # (50, 2)
            assert torch.allclose(pair[:-k] @ rot.T, pair[k:], atol=1e-12)
    # any offset and any length, also far beyond what was built before
    assert torch.allclose(pe(3, offset=5000, device="cpu", dtype=torch.float64)[:, 0],
                          torch.sin(torch.arange(5000, 5003, dtype=torch.float64)), atol=1e-9)
    assert torch.allclose(pe(4, offset=10, device="cpu", dtype=torch.float64), table[10:14])


def test_embedding_scale_and_positions():
    model = _model(seed=7, encoder_layers=1)
    ids = torch.tensor([[5, 6, 0]])
    x = model._embed(model.src_embed, ids, offset=2)
    expect = model.src_embed.weight[ids] * D**0.5 + SinusoidalPositions(D)(3, offset=2)
    assert torch.allclose(x, expect, atol=1e-6)
    assert torch.equal(model.src_embed.weight[0], torch.zeros(D))  # pad row


def test_word_dropout_drops_whole_tokens_while_training_only():
    """A dropped token keeps only its position encoding; kept tokens are unscaled; eval drops nothing."""
    model = _model(seed=7, encoder_layers=1, word_dropout=0.4)
    ids = torch.randint(4, 30, (50, 40), generator=torch.Generator().manual_seed(3))  # (B, T)
    full = model._embed(model.src_embed, ids)  # eval mode
    positions = SinusoidalPositions(D)(40).expand_as(full)  # (B, T, D)
    assert torch.allclose(full, model.src_embed.weight[ids] * D**0.5 + positions, atol=1e-6)
    model.train()
    torch.manual_seed(0)
    x = model._embed(model.src_embed, ids)
    is_dropped = torch.isclose(x, positions, atol=1e-6).all(-1)  # (B, T)
    is_kept = torch.isclose(x, full, atol=1e-6).all(-1)
    assert torch.equal(is_dropped, ~is_kept)  # each token is either whole or gone
    assert abs(is_dropped.float().mean().item() - 0.4) < 0.03  # 2,000 draws: std 0.011
    torch.manual_seed(0)
    assert torch.equal(model._embed(model.src_embed, ids), x)  # seeded: reproducible, so resume is exact
    src, tgt = _src_batch()
    torch.manual_seed(1)
    a = model(src, tgt)
    torch.manual_seed(2)
    assert not torch.allclose(a, model(src, tgt))  # the masks differ, so both stacks see it
    model.eval()
    assert torch.equal(model(src, tgt), model(src, tgt))


def test_tied_and_untied_embeddings():
    model = _model()
    assert model.src_embed.weight is model.tgt_embed.weight is model.output.weight
    cfg = Config(model=_cfg())
    different = build_model(cfg, 40, 30)
    assert different.tgt_embed.weight is different.output.weight
    assert different.src_embed.weight is not different.tgt_embed.weight
    untied = build_model(Config(model=_cfg(tie_embeddings=False)), 30, 30)
    assert len({id(untied.src_embed.weight), id(untied.tgt_embed.weight), id(untied.output.weight)}) == 3
    n_tied = sum(p.numel() for p in model.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 2 * 30 * D


def test_pre_norm_has_final_layer_norms_and_training_step_works():
    pre, post = _model(norm="pre", dropout=0.1), _model(norm="post")
    assert isinstance(pre.encoder_norm, torch.nn.LayerNorm) and isinstance(pre.decoder_norm, torch.nn.LayerNorm)
    assert not isinstance(post.encoder_norm, torch.nn.LayerNorm)
    pre.train()
    src, tgt = _src_batch()
    loss = torch.nn.functional.cross_entropy(pre(src, tgt).flatten(0, 1), tgt.flatten())
    loss.backward()
    grads = [p.grad for p in pre.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert dataclasses.asdict(pre.cfg)["norm"] == "pre"


def test_bf16_training_route_is_causal_and_matches_sdpa():
    """CPU bf16 training takes the explicit attention path: still causal, same numbers as SDPA."""
    torch.manual_seed(0)
    cfg = Config()
    cfg.model.dropout = 0.0
    model = build_model(cfg, 300, 300).train()
    src = torch.randint(4, 300, (4, 11))
    src[0, 7:] = 0  # padding in one source
    tgt = torch.randint(4, 300, (4, 9))
    changed = tgt.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 296 + 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = model(src, tgt), model(src, changed)
        with torch.no_grad():  # no grad: the SDPA route
            ref = model(src, tgt)
    assert torch.equal(a[:, :5], b[:, :5]) and not torch.equal(a[:, 5:], b[:, 5:])
    torch.testing.assert_close(a.float(), ref.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_rate_expectation_and_gradient(dtype):
    """The bit-sliced CPU dropout drops ~p, keeps E[x], scales kept values by 1/keep, and backprops the same mask."""
    p = 0.3
    drop = Dropout(p).train()
    x = torch.ones(200_000, dtype=dtype, requires_grad=True)
    torch.manual_seed(0)
    y = drop(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - p) < 0.005  # 200k Bernoulli(0.3) draws: std 0.001
    scale = 65536 / (65536 - round(p * 65536))
    kept = y[y != 0].float()
    assert torch.equal(kept, torch.full_like(kept, float(torch.tensor(scale, dtype=dtype))))
    assert abs(y.float().mean().item() - 1.0) < 0.01
    y.backward(torch.full_like(y, 2.0))
    assert torch.equal(x.grad == 0, y == 0)  # the same mask
    torch.manual_seed(0)
    assert torch.equal(drop(x.detach()), y.detach())  # seeded: reproducible
    assert torch.equal(drop.eval()(x), x)
    assert torch.equal(Dropout(0.0).train()(x), x)


def test_dropout_masks_are_independent_across_lanes():
    """Each int64 draw feeds four elements: neighbours must still be dropped independently."""
    torch.manual_seed(1)
    y = Dropout(0.5).train()(torch.ones(400_000)).view(-1, 4) == 0  # (N, 4) per-draw lanes
    for lane in range(4):
        assert abs(y[:, lane].float().mean().item() - 0.5) < 0.01
    both = (y[:, 0] & y[:, 1]).float().mean().item()
    assert abs(both - 0.25) < 0.01  # independent lanes: P(both dropped) = 0.25
