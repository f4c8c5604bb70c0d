"""The paths that only a GPU takes (SDPA with masks, F.dropout, CUDA autocast, fp16 GradScaler, CUDA RNG
state on resume), checked against float64 formulas and CPU references.

Skipped without CUDA; `scripts/gpu_check.sh` runs them on a lent GPU. TCLI_TEST_DEVICE=cpu runs the
same checks on the CPU, to try the tests themselves on a machine without one.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from transformer_cli import search
from transformer_cli.attention import MultiHeadAttention, causal_mask, masked_softmax, sequence_mask
from transformer_cli.config import DecodeConfig, ModelConfig
from transformer_cli.model import Dropout, Seq2SeqTransformer
from transformer_cli.plots import read_metrics
from transformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID

from .conftest import ROOT, run_tcli

DEVICE = torch.device(os.environ.get("TCLI_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device (TCLI_TEST_DEVICE=cpu runs these checks on the CPU)")
PRECISIONS = ["fp32", "bf16"] + (["fp16"] if DEVICE.type == "cuda" else [])  # fp16 training is CUDA-only


def _formula(mha: MultiHeadAttention, query, key, value, mask):
    """Textbook multi-head attention in float64 on the CPU: softmax(Q K^T / sqrt(d_k)) V per head, concat, W^O."""
    d, H, D = mha.d_model, mha.num_heads, mha.head_dim
    W, b = mha.in_proj_weight.double().cpu(), mha.in_proj_bias.double().cpu()

    def heads(x, rows):  # (B, T, d) -> (B, H, T, D)
        y = x.double().cpu() @ W[rows].T + b[rows]
        return y.view(y.shape[0], y.shape[1], H, D).transpose(1, 2)

    q, k, v = heads(query, slice(0, d)), heads(key, slice(d, 2 * d)), heads(value, slice(2 * d, 3 * d))
    weights = masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(D), mask=mask.cpu())  # (B, H, Tq, Tk)
    out = (weights @ v).transpose(1, 2).reshape(q.shape[0], q.shape[2], d)  # (B, Tq, d)
    return out @ mha.out_proj.weight.double().cpu().T + mha.out_proj.bias.double().cpu()


@pytest.mark.parametrize("masks", ["padding", "padding+causal", "causal"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attention_on_device_matches_the_float64_formula(masks, precision):
    """Self-attention as the encoder (padding mask) and the decoder (causal flag, with or without a
    padding mask: SDPA's own causal kernel when there is none) use it, forward and backward."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4)
    for p in mha.parameters():
        torch.nn.init.normal_(p, std=0.3)  # non-zero biases, so a misplaced one shows
    B, T = 3, 9
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    keep = sequence_mask(torch.tensor([T, 4, 0]), T)[:, None, None, :]  # (B, 1, 1, T); row 2: no key at all
    if masks == "causal":
        keep = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask = keep & causal_mask(T) if "causal" in masks else keep  # (B, 1, T, T)
    expect = _formula(mha, x, x, x, mask)
    grad_out = torch.randn(B, T, 32, dtype=torch.float64)
    (expect_grad,) = torch.autograd.grad((expect * grad_out).sum(), x)

    ours = mha.to(DEVICE)
    xd = x.detach().float().to(DEVICE).requires_grad_()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with torch.autocast(DEVICE.type, dtype=dtype, enabled=precision == "bf16"):
        given = None if masks == "causal" else keep.to(DEVICE)
        out, _ = ours(xd, xd, xd, mask=given, causal="causal" in masks)
    (out.float() * grad_out.float().to(DEVICE)).sum().backward()
    out, grad = out.double().cpu(), xd.grad.double().cpu()
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    if masks != "causal":  # a query row with no key gives a zero attention output: only W^O's bias is left
        bias = mha.out_proj.bias.double().cpu().expand(T, 32)
        assert torch.allclose(out[2], bias, atol=1e-5 if precision == "fp32" else 1e-2)
    if precision == "fp32":
        assert torch.allclose(out, expect, atol=1e-4), (out - expect).abs().max()
        assert torch.allclose(grad, expect_grad, atol=1e-4), (grad - expect_grad).abs().max()
    else:  # bf16 keeps 8 bits of mantissa: compare relative to the size of the numbers
        assert (out - expect).abs().max() <= 0.03 * expect.abs().max()
        assert (grad - expect_grad).abs().max() <= 0.03 * expect_grad.abs().max()


def test_dropout_on_device_is_unbiased_and_seeded():
    x = torch.ones(1_000_000, device=DEVICE)
    drop = Dropout(0.3).train()
    torch.manual_seed(5)
    y = drop(x)
    torch.manual_seed(5)
    assert torch.equal(drop(x), y)  # the global seed decides the mask (exact resume relies on it)
    zeros = (y == 0).float().mean().item()
    assert abs(zeros - 0.3) < 5 * math.sqrt(0.3 * 0.7 / x.numel())  # 5 sigma
    kept = y[y != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / 0.7))


def _tiny_model():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, num_heads=4, ff_size=64, encoder_layers=2, decoder_layers=2, dropout=0.0, norm="pre")
    model = Seq2SeqTransformer(cfg, 40, 40)
    with torch.no_grad():  # a peakier output so that hypotheses end at varied lengths
        model.output.weight.mul_(3.0)
    return model.eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 40, (4, 11), generator=g)
    src[1, 7:] = PAD_ID
    src[3, 2:] = PAD_ID
    tgt = torch.randint(4, 40, (4, 8), generator=g)
    tgt[:, 0] = BOS_ID
    return src, tgt


def test_model_on_device_matches_cpu_and_cached_decoding_matches_full():
    cpu_model = _tiny_model()
    src, tgt = _batch()
    with torch.no_grad():
        expect = cpu_model(src, tgt)
    model = _tiny_model().to(DEVICE)
    src_d, tgt_d = src.to(DEVICE), tgt.to(DEVICE)
    with torch.no_grad():
        full = model(src_d, tgt_d)
        assert torch.allclose(full.cpu(), expect, atol=1e-4), (full.cpu() - expect).abs().max()
        src_mask = src_d != PAD_ID
        memory = model.encode(src_d, src_mask)
        cache = model.new_cache()
        steps = [model.decode(tgt_d[:, t : t + 1], memory, src_mask, cache=cache) for t in range(tgt.shape[1])]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-4)


def _forced_logprob(model, src: list[int], tokens: list[int]) -> float:
    """Summed log-probability of `tokens` + EOS given src (float64 CPU model, teacher forcing)."""
    tgt_in = torch.tensor([[BOS_ID, *tokens]])
    gold = torch.tensor([*tokens, EOS_ID])
    with torch.no_grad():
        logp = model(torch.tensor([src + [EOS_ID]]), tgt_in)[0].log_softmax(-1)  # (T, V)
    return logp.gather(1, gold[:, None]).sum().item()


@pytest.mark.parametrize("beam", [1, 4])
def test_search_on_device_scores_its_outputs_like_the_cpu(beam):
    """Every hypothesis decoded on the device has the log-probability the CPU model (float64) gives it;
    cached and uncached decoding agree; beam 1 equals greedy."""
    rng = random.Random(1)
    sources = [[rng.randrange(4, 40) for _ in range(rng.randrange(1, 20))] for _ in range(24)]
    cfg = DecodeConfig(max_len_a=1.0, max_len_b=4, max_tokens=4000)
    model = _tiny_model().to(DEVICE)
    hyps = search.decode_nbest(model, sources, cfg, DEVICE, beam=beam, nbest=beam)
    plain = search.decode_nbest(model, sources, cfg, DEVICE, beam=beam, nbest=beam, use_cache=False)
    assert [[h.tokens for h in n] for n in hyps] == [[h.tokens for h in n] for n in plain]
    reference = _tiny_model().double()
    for src, nbest in zip(sources, hyps):
        assert len(nbest) == beam
        for h in nbest:
            assert h.logprob == pytest.approx(_forced_logprob(reference, src, h.tokens), abs=1e-4)
    if beam == 1:  # decode_nbest takes greedy_search for beam 1; beam_search with beam 1 must agree
        for s, greedy in list(zip(sources, hyps))[:8]:
            src, mask = search.pad_sources(search.prepare_sources([s], 256), DEVICE)
            max_len = search.max_output_len(len(s), 1.0, 4, 255)
            with torch.inference_mode():
                b = search.beam_search(model, src, mask, beam=1, alpha=0.6, max_len=max_len)[0][0]
            assert b.tokens == greedy[0].tokens
    assert len({len(n[0].tokens) for n in hyps}) > 3  # varied lengths: the batch shrank as rows ended


def test_search_in_bf16_on_device_runs_and_mostly_agrees():
    """bf16 decoding gives finite scores and, on this model, the fp32 output for most sentences."""
    rng = random.Random(2)
    sources = [[rng.randrange(4, 40) for _ in range(rng.randrange(1, 20))] for _ in range(24)]
    model = _tiny_model().to(DEVICE)
    fp32 = search.decode_nbest(model, sources, DecodeConfig(max_len_a=1.0, max_len_b=4, beam=3), DEVICE)
    bf16 = search.decode_nbest(model, sources, DecodeConfig(max_len_a=1.0, max_len_b=4, beam=3, precision="bf16"),
                               DEVICE)
    assert all(math.isfinite(n[0].score) for n in bf16)
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(fp32, bf16))
    assert same >= len(sources) // 2, same


def _losses(run_dir):
    return {r["step"]: r["train_loss"] for r in read_metrics(run_dir) if "train_loss" in r}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_train_resume_and_translate_on_device(tmp_path, multi30k, precision):
    """tcli train on the device (autocast, fp16 loss scaling) stopped and resumed logs the losses of an
    uninterrupted run; tcli translate --device then translates."""
    common = ("--config", ROOT / "configs" / "smoke.yaml", "--set", f"data.path={multi30k}",
              "--set", f"train.device={DEVICE}", "--set", f"train.precision={precision}",
              "--set", "train.valid_every=20", "--set", "train.log_every=5", "--set", "train.valid_beam=1", "--quiet")
    whole, part = tmp_path / "whole", tmp_path / "part"
    r = run_tcli("train", *common, "--run-dir", whole, "--set", "train.max_steps=30")
    assert r.returncode == 0, r.stderr
    r = run_tcli("train", *common, "--run-dir", part, "--set", "train.max_steps=20")
    assert r.returncode == 0, r.stderr
    r = run_tcli("train", *common, "--run-dir", part, "--set", "train.max_steps=30", "--resume")
    assert r.returncode == 0, r.stderr
    a, b = _losses(whole), _losses(part)
    assert max(a) == max(b) == 30
    # After the resume: the same data order, dropout masks and optimizer state. In fp32 only float noise
    # may differ (CUDA kernels need not be deterministic); a dropout stream that was not restored moves
    # these losses by ~1e-4 (measured on the CPU). Autocast rounds that noise up, so in bf16/fp16 the
    # check is only that training went on from step 20 (a fresh start logs ~7.0 at step 25, not ~6.0).
    rel = 2e-5 if precision == "fp32" else 1e-2
    for step in (25, 30):
        assert math.isfinite(b[step])
        assert b[step] == pytest.approx(a[step], rel=rel)
    lines = ["Ein Mann fährt Fahrrad.", "", "Zwei Hunde spielen im Schnee."]
    r = run_tcli("translate", "--run-dir", part, "--device", str(DEVICE), "--precision",
                 "bf16" if precision == "bf16" else "fp32", "--quiet", input="\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr
    out = r.stdout.split("\n")
    assert len(out) == 4 and out[1] == "" and out[0] and out[2]
