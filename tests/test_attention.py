"""The attention core against the course-notes formulas and torch.nn.MultiheadAttention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from transformer_cli.attention import (
    AdditiveAttention,
    DotProductAttention,
    KVCache,
    MultiHeadAttention,
    causal_mask,
    kernel_regression,
    masked_softmax,
    sequence_mask,
)


def test_notes_numbers():
    """Queries (1,2),(1,1), keys (1,0),(0,1), d_k=2 give weights (0.33, 0.67) and (0.50, 0.50)."""
    q = torch.tensor([[[1.0, 2.0], [1.0, 1.0]]])
    k = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    v = torch.tensor([[[10.0], [20.0]]])
    attn = DotProductAttention(dropout=0.0)
    out = attn(q, k, v)
    w = attn.attention_weights[0]
    assert torch.allclose(w, torch.tensor([[0.33, 0.67], [0.50, 0.50]]), atol=0.005)
    first = 1 / (1 + math.exp(1 / math.sqrt(2)))  # softmax([1, 2] / sqrt 2)[0]
    assert w[0, 0].item() == pytest.approx(first, abs=1e-6)
    assert torch.allclose(out[0, :, 0], w @ v[0, :, 0])


def test_sequence_and_causal_mask():
    assert sequence_mask(torch.tensor([0, 2, 3]), 3).tolist() == [
        [False, False, False], [True, True, False], [True, True, True]]
    assert causal_mask(3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # offset: two new queries at positions 2 and 3 of a 4-step sequence
    assert causal_mask(2, offset=2).tolist() == [[True, True, True, False], [True, True, True, True]]


def _reference_softmax(scores, mask):
    """Row by row: softmax over the allowed entries only, zeros elsewhere (zeros for empty rows)."""
    out = torch.zeros_like(scores)
    flat_s, flat_m, flat_o = scores.reshape(-1, scores.shape[-1]), mask.reshape(-1, scores.shape[-1]), out.view(-1, scores.shape[-1])
    for i in range(flat_s.shape[0]):
        if flat_m[i].any():
            flat_o[i, flat_m[i]] = torch.softmax(flat_s[i, flat_m[i]], dim=0)
    return out


def test_masked_softmax_valid_lens_1d():
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5)
    p = masked_softmax(scores, torch.tensor([2, 4]))
    mask = torch.arange(5) < torch.tensor([2, 4])[:, None, None]
    assert torch.equal(p[~mask.expand_as(p)], torch.zeros(int((~mask.expand_as(p)).sum())))
    assert torch.allclose(p.sum(-1), torch.ones(2, 3))
    assert torch.allclose(p, _reference_softmax(scores, mask.expand_as(scores)), atol=1e-6)


def test_masked_softmax_valid_lens_2d_and_heads():
    torch.manual_seed(1)
    lens = torch.tensor([[1, 3, 5], [2, 4, 0]])  # (B, Tq): one length per query row
    scores = torch.randn(2, 4, 3, 5)  # (B, H, Tq, Tk)
    p = masked_softmax(scores, lens)
    mask = (torch.arange(5) < lens[..., None])[:, None].expand_as(scores)
    assert torch.allclose(p, _reference_softmax(scores, mask), atol=1e-6)
    assert torch.equal(p[1, :, 2], torch.zeros(4, 5))  # the zero-length row


def test_masked_softmax_bool_mask_combined_with_lens():
    torch.manual_seed(2)
    scores = torch.randn(2, 3, 4)
    mask = torch.tensor([[True, False, True, True]])  # (1, Tk) broadcasts to every row
    p = masked_softmax(scores, torch.tensor([3, 2]), mask=mask)
    full = mask & (torch.arange(4) < torch.tensor([3, 2])[:, None, None])
    assert torch.allclose(p, _reference_softmax(scores, full.expand_as(scores)), atol=1e-6)
    assert (p[..., 1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masked_softmax_empty_row_is_zero_with_finite_grads(dtype):
    torch.manual_seed(3)
    scores = (torch.randn(2, 3, 4) * 5).to(dtype).requires_grad_()
    p = masked_softmax(scores, torch.tensor([0, 2]))
    assert p.dtype == dtype
    assert torch.equal(p[0].float(), torch.zeros(3, 4))
    assert torch.isfinite(p.float()).all()
    assert torch.allclose(p[1].float().sum(-1), torch.ones(3), atol=1e-2)
    (p.float() * torch.randn(2, 3, 4)).sum().backward()
    assert torch.isfinite(scores.grad.float()).all()
    assert torch.equal(scores.grad[0].float(), torch.zeros(3, 4))  # nothing flows through an empty row


def test_dot_product_attention_with_valid_lens():
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 6)
    attn = DotProductAttention(0.0)
    out = attn(q, k, v, valid_lens=torch.tensor([2, 5]))
    mask = (torch.arange(5) < torch.tensor([2, 5])[:, None, None]).expand(2, 3, 5)
    w = _reference_softmax(q @ k.transpose(1, 2) / math.sqrt(8), mask)
    assert torch.allclose(attn.attention_weights, w, atol=1e-6)
    assert torch.allclose(out, w @ v, atol=1e-6)


def test_additive_attention_equals_formula_by_hand():
    torch.manual_seed(5)
    attn = AdditiveAttention(key_size=3, query_size=4, num_hiddens=6, dropout=0.0)
    q, k, v = torch.randn(2, 2, 4), torch.randn(2, 5, 3), torch.randn(2, 5, 7)
    lens = torch.tensor([3, 5])
    out = attn(q, k, v, valid_lens=lens)
    Wq, Wk, wv = attn.W_q.weight, attn.W_k.weight, attn.w_v.weight[0]
    for b in range(2):
        for i in range(2):
            n = int(lens[b])
            scores = torch.stack([wv @ torch.tanh(Wq @ q[b, i] + Wk @ k[b, j]) for j in range(n)])
            alpha = torch.softmax(scores, 0)
            assert torch.allclose(attn.attention_weights[b, i, :n], alpha, atol=1e-6)
            assert (attn.attention_weights[b, i, n:] == 0).all()
            assert torch.allclose(out[b, i], alpha @ v[b, :n], atol=1e-6)


def test_kernel_regression_is_nadaraya_watson():
    torch.manual_seed(6)
    x_train, y_train = torch.rand(20) * 5, torch.randn(20)
    x_test = torch.linspace(0, 5, 7)
    pred, w = kernel_regression(x_test, x_train, y_train, bandwidth=0.5)
    for i, x in enumerate(x_test):
        kern = torch.exp(-((x - x_train) ** 2) / (2 * 0.5**2))
        assert torch.allclose(w[i], kern / kern.sum(), atol=1e-6)
        assert pred[i].item() == pytest.approx((kern @ y_train / kern.sum()).item(), abs=1e-5)
    # a tiny bandwidth turns it into nearest-neighbour regression
    pred, _ = kernel_regression(x_train[:3], x_train, y_train, bandwidth=1e-3)
    assert torch.allclose(pred, y_train[:3], atol=1e-5)


def _torch_pair(d_model=16, num_heads=4, bias=True, seed=0):
    torch.manual_seed(seed)
    ours = MultiHeadAttention(d_model, num_heads, bias=bias)
    ref = torch.nn.MultiheadAttention(d_model, num_heads, bias=bias, batch_first=True)
    for p in ours.parameters():  # non-zero biases so that a misplaced bias shows
        torch.nn.init.normal_(p, std=0.3)
    ref.load_state_dict(ours.state_dict())  # same parameter names and layout
    return ours, ref


def test_mha_equals_torch_self_attention_with_padding_mask():
    ours, ref = _torch_pair()
    x = torch.randn(3, 6, 16)
    keep = sequence_mask(torch.tensor([6, 4, 1]), 6)  # (B, Tk) True = real token
    expect, expect_w = ref(x, x, x, key_padding_mask=~keep, need_weights=True, average_attn_weights=False)
    for need_weights in (False, True):
        out, w = ours(x, x, x, mask=keep[:, None, None, :], need_weights=need_weights)
        assert torch.allclose(out, expect, atol=1e-5)
    assert torch.allclose(w, expect_w, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_mha_equals_torch_causal(bias):
    ours, ref = _torch_pair(bias=bias, seed=1)
    x = torch.randn(2, 5, 16)
    expect, _ = ref(x, x, x, attn_mask=~causal_mask(5), need_weights=False)
    assert torch.allclose(ours(x, x, x, causal=True)[0], expect, atol=1e-5)
    assert torch.allclose(ours(x, x, x, mask=causal_mask(5))[0], expect, atol=1e-5)
    out, w = ours(x, x, x, causal=True, need_weights=True)
    assert torch.allclose(out, expect, atol=1e-5)
    assert (w[..., ~causal_mask(5)] == 0).all()


def test_mha_equals_torch_cross_attention():
    ours, ref = _torch_pair(seed=2)
    q, mem, val = torch.randn(2, 3, 16), torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    keep = sequence_mask(torch.tensor([7, 2]), 7)
    expect, _ = ref(q, mem, mem, key_padding_mask=~keep)
    assert torch.allclose(ours(q, mem, mem, mask=keep[:, None, None, :])[0], expect, atol=1e-5)
    expect, _ = ref(q, mem, val, key_padding_mask=~keep)  # keys and values from different tensors
    assert torch.allclose(ours(q, mem, val, mask=keep[:, None, None, :])[0], expect, atol=1e-5)


def test_fast_path_equals_explicit_path_and_empty_rows_are_zero():
    torch.manual_seed(7)
    mha = MultiHeadAttention(16, 2)
    q, kv = torch.randn(2, 4, 16, requires_grad=True), torch.randn(2, 6, 16, requires_grad=True)
    mask = torch.rand(2, 1, 4, 6) > 0.5
    mask[0, 0, 1] = False  # a query row with nothing to attend to
    mask[1, 0, 3] = False
    grads = []
    for need_weights in (False, True):
        out, _ = mha(q, kv, kv, mask=mask, need_weights=need_weights)
        assert torch.isfinite(out).all()
        assert torch.allclose(out[0, 1], mha.out_proj.bias, atol=1e-6)  # zero attention output, + bias
        (out * torch.linspace(-1, 1, 16)).sum().backward()
        grads.append((q.grad.clone(), kv.grad.clone()))
        q.grad = kv.grad = None
        if not need_weights:
            fast = out
    assert torch.allclose(fast, out, atol=1e-5)
    for g_fast, g_explicit in zip(*grads):
        assert torch.isfinite(g_fast).all()
        assert torch.allclose(g_fast, g_explicit, atol=1e-5)


def test_self_attention_is_permutation_equivariant():
    torch.manual_seed(8)
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(2, 7, 16)
    perm = torch.randperm(7)
    out, _ = mha(x, x, x)
    out_perm, _ = mha(x[:, perm], x[:, perm], x[:, perm])
    assert torch.allclose(out_perm, out[:, perm], atol=1e-5)


def test_kv_cache_update_reorder_reset():
    cache = KVCache(2)
    assert cache.length == 0 and cache.get_cross(1) is None
    k1, v1 = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    k2, v2 = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    cache.update(0, k1, v1)
    k_all, v_all = cache.update(0, k2, v2)
    assert torch.equal(k_all, torch.cat([k1, k2], 2)) and torch.equal(v_all, torch.cat([v1, v2], 2))
    assert cache.length == 3
    ck, cv = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    cache.set_cross(1, ck, cv)
    index = torch.tensor([2, 2, 0])
    cache.reorder(index)
    assert torch.equal(cache.update(0, k1[:, :, :0], v1[:, :, :0])[0], k_all[index])
    assert torch.equal(cache.get_cross(1)[0], ck[index]) and torch.equal(cache.get_cross(1)[1], cv[index])
    cache.reset()
    assert cache.length == 0 and cache.get_cross(1) is None


def test_mha_incremental_with_cache_equals_full():
    torch.manual_seed(9)
    self_attn, cross_attn = MultiHeadAttention(16, 4), MultiHeadAttention(16, 4)
    x, mem = torch.randn(2, 6, 16), torch.randn(2, 5, 16)
    mem_mask = sequence_mask(torch.tensor([5, 3]), 5)[:, None, None, :]
    full_self, _ = self_attn(x, x, x, causal=True)
    full_cross, _ = cross_attn(x, mem, mem, mask=mem_mask)
    cache = KVCache(1)
    steps_self, steps_cross = [], []
    for chunk in (x[:, :1], x[:, 1:4], x[:, 4:5], x[:, 5:]):  # one and several tokens per call
        steps_self.append(self_attn(chunk, chunk, chunk, cache=cache, layer=0, kind="self", causal=True)[0])
        steps_cross.append(cross_attn(chunk, mem, mem, mask=mem_mask, cache=cache, layer=0, kind="cross")[0])
    assert cache.length == 6
    assert torch.allclose(torch.cat(steps_self, 1), full_self, atol=1e-5)
    assert torch.allclose(torch.cat(steps_cross, 1), full_cross, atol=1e-5)
    # the cross keys/values were projected once and are reused even if `key` changes
    again, _ = cross_attn(x[:, :1], torch.zeros_like(mem), torch.zeros_like(mem), mask=mem_mask, cache=cache, layer=0, kind="cross")
    assert torch.allclose(again, full_cross[:, :1], atol=1e-5)
