"""Search: golden results on a scripted toy model, beam 1 == greedy, cache == no cache, batch invariance."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from transformer_cli import search
from transformer_cli.config import DecodeConfig, ModelConfig
from transformer_cli.model import Seq2SeqTransformer
from transformer_cli.search import EOS_ID, Hypothesis, beam_search, greedy_search, length_penalty, pad_sources

from .fixtures_model import one_thread  # noqa: F401  (1 thread: tiny ops on a shared CPU only wait with more)

A, B_ = 4, 5  # the toy's two word tokens (ids 0-3 are the specials)


@pytest.fixture(autouse=True, scope="module")
def _single_thread(one_thread):  # noqa: F811
    yield
V = 6


class ToyCache:
    """The toy's explicit cache: the prefix of every row (so decode sees one new token per step)."""

    def __init__(self):
        self.tokens = None

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[1]

    def reorder(self, index, cross=True):
        self.tokens = self.tokens.index_select(0, index)


class ToyModel:
    """Next-token log-probs given by `table(key, prefix)`; key = the first source token."""

    training = False

    def __init__(self, table):
        self.table = table
        self.calls = 0

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def encode(self, src, src_mask):
        return src.float()[:, :, None]  # (B, S, 1): decode reads the key from it

    def new_cache(self):
        return ToyCache()

    def decode(self, tgt_in, memory, src_mask, cache=None, need_weights=False):
        self.calls += 1
        if cache is not None:
            cache.tokens = tgt_in if cache.tokens is None else torch.cat([cache.tokens, tgt_in], 1)
            full, positions = cache.tokens, range(cache.length - tgt_in.shape[1], cache.length)
        else:
            full, positions = tgt_in, range(tgt_in.shape[1])
        keys = memory[:, 0, 0].long().tolist()
        rows = [[self.logp(k, tuple(full[r, 1 : t + 1].tolist())) for t in positions] for r, k in enumerate(keys)]
        return torch.tensor(rows, dtype=torch.float32)  # (B, T, V)

    def logp(self, key, prefix):
        """Log-probs over the 6 ids; only EOS, A and B are possible."""
        probs = self.table(key, prefix)
        out = [-math.inf] * V
        for tok, p in probs.items():
            out[tok] = math.log(p)
        return out


def designed_table(key, prefix):
    """Greedy takes A (0.6) then A (0.4) then EOS: 0.12; the best sequence is B EOS: 0.36."""
    return {(): {A: 0.6, B_: 0.4}, (A,): {EOS_ID: 0.25, A: 0.4, B_: 0.35},
            (B_,): {EOS_ID: 0.9, A: 0.06, B_: 0.04}}.get(prefix, {EOS_ID: 0.5, A: 0.3, B_: 0.2})


def random_table(key, prefix):
    """A fixed pseudo-random distribution per (key, prefix)."""
    rng = random.Random(f"{key}:{prefix}")
    w = [rng.random() ** 2 + 0.01 for _ in range(3)]
    return {tok: x / sum(w) for tok, x in zip((EOS_ID, A, B_), w)}


def exhaustive(table, key, max_len, alpha, n):
    """All hypotheses of at most max_len tokens (then EOS), best n by log-prob / length penalty."""
    out = []
    for length in range(max_len + 1):
        for seq in itertools.product((A, B_), repeat=length):
            lp = sum(math.log(table(key, seq[:i])[seq[i]]) for i in range(length))
            lp += math.log(table(key, seq)[EOS_ID])
            out.append((lp / length_penalty(length + 1, alpha), list(seq), lp))
    out.sort(key=lambda x: -x[0])
    return out[:n]


def toy_src(keys):
    return pad_sources([[k, EOS_ID] for k in keys], "cpu")


def test_beam_finds_best_sequence_that_greedy_misses():
    model = ToyModel(designed_table)
    src, mask = toy_src([7])
    greedy = greedy_search(model, src, mask, max_len=5)[0]
    best = beam_search(model, src, mask, beam=2, alpha=0.0, max_len=5)[0][0]
    assert greedy.tokens == [A, A]
    assert greedy.logprob == pytest.approx(math.log(0.6 * 0.4 * 0.5), abs=1e-6)
    assert best.tokens == [B_]
    assert best.score == pytest.approx(math.log(0.4 * 0.9), abs=1e-6)
    assert best.logprob == pytest.approx(math.log(0.36), abs=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_beam_equals_exhaustive_search(alpha):
    """With more beams than prefixes, beam search (and its early stop) must be exact, n-best included."""
    keys, max_len, nbest = [11, 12, 13, 14, 15], 3, 4
    src, mask = toy_src(keys)
    got = beam_search(ToyModel(random_table), src, mask, beam=16, alpha=alpha, max_len=max_len, nbest=nbest)
    for key, hyps in zip(keys, got):
        want = exhaustive(random_table, key, max_len, alpha, nbest)
        assert [h.tokens for h in hyps] == [w[1] for w in want]
        assert [h.score for h in hyps] == pytest.approx([w[0] for w in want], abs=1e-5)
        assert [h.logprob for h in hyps] == pytest.approx([w[2] for w in want], abs=1e-5)


def test_nbest_scores_follow_the_formula_and_limits_hold():
    model = ToyModel(random_table)
    src, mask = toy_src([3, 4, 5, 6])
    got = beam_search(model, src, mask, beam=4, alpha=0.6, max_len=[2, 3, 4, 5], min_len=2, nbest=4)
    for key, max_len, hyps in zip([3, 4, 5, 6], [2, 3, 4, 5], got):
        assert len(hyps) == 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            assert 2 <= len(h.tokens) <= max_len
            lp = sum(math.log(random_table(key, tuple(h.tokens[:i]))[h.tokens[i]]) for i in range(len(h.tokens)))
            lp += math.log(random_table(key, tuple(h.tokens))[EOS_ID])
            assert h.logprob == pytest.approx(lp, abs=1e-5)
            assert h.score == pytest.approx(lp / length_penalty(len(h.tokens) + 1, 0.6), abs=1e-5)


def test_toy_cached_equals_uncached_and_batch_order():
    keys = list(range(20, 45))
    src, mask = toy_src(keys)
    cached = beam_search(ToyModel(random_table), src, mask, beam=3, alpha=0.6, max_len=6, nbest=3)
    plain = beam_search(ToyModel(random_table), src, mask, beam=3, alpha=0.6, max_len=6, nbest=3, use_cache=False)
    assert [[h.tokens for h in x] for x in cached] == [[h.tokens for h in x] for x in plain]
    for i in (0, 7, 24):  # each sentence alone gives its own result (compaction kept rows straight)
        s1, m1 = toy_src([keys[i]])
        alone = beam_search(ToyModel(random_table), s1, m1, beam=3, alpha=0.6, max_len=6, nbest=3)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in cached[i]]


# ---------------------------------------------------------------------------------------------
# A small random Transformer (real attention, real cache)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, num_heads=4, ff_size=64, encoder_layers=2, decoder_layers=2, dropout=0.0)
    model = Seq2SeqTransformer(cfg, 40, 40).eval()
    with torch.no_grad():  # a peakier output so hypotheses end at varied lengths
        model.output.weight.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def sources():
    rng = random.Random(1)
    return [[rng.randrange(4, 40) for _ in range(rng.randrange(0, 24))] for _ in range(32)]


def _cfg(**kw):
    return DecodeConfig(**{"max_len_a": 1.0, "max_len_b": 4, "max_tokens": 4000, **kw})


def test_beam1_equals_greedy(tiny_model, sources):
    greedy = search.decode_nbest(tiny_model, sources, _cfg(), "cpu", beam=1)  # batched
    inputs = search.prepare_sources(sources, tiny_model.cfg.max_len)
    for s, g in zip(inputs[:12], greedy[:12]):
        src, mask = pad_sources([s], "cpu")
        max_len = search.max_output_len(len(s) - 1, 1.0, 4, 255)
        with torch.inference_mode():
            b = beam_search(tiny_model, src, mask, beam=1, alpha=0.6, max_len=max_len)[0][0]
        assert b.tokens == g[0].tokens
        assert b.logprob == pytest.approx(g[0].logprob, abs=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_cached_equals_uncached(tiny_model, sources, beam):
    cached = search.decode_nbest(tiny_model, sources, _cfg(), "cpu", beam=beam, nbest=beam)
    plain = search.decode_nbest(tiny_model, sources, _cfg(), "cpu", beam=beam, nbest=beam, use_cache=False)
    for c, p in zip(cached, plain):
        assert [h.tokens for h in c] == [h.tokens for h in p]
        assert [h.score for h in c] == pytest.approx([h.score for h in p], abs=1e-5)


@pytest.mark.parametrize("beam", [1, 3])
def test_batch_invariance_bitwise(tiny_model, sources, beam):
    """Batch of everything vs one sentence at a time vs shuffled small batches: identical bits."""
    cfg = _cfg()
    big = search.decode_nbest(tiny_model, sources, cfg, "cpu", beam=beam, nbest=beam)
    alone = [search.decode_nbest(tiny_model, [s], cfg, "cpu", beam=beam, nbest=beam)[0] for s in sources[:10]]
    order = list(range(len(sources)))
    random.Random(2).shuffle(order)
    small_cfg = _cfg(max_tokens=80)  # a few sentences per batch, in another order
    shuffled = search.decode_nbest(tiny_model, [sources[i] for i in order], small_cfg, "cpu", beam=beam, nbest=beam)
    unshuffled = [None] * len(order)
    for pos, i in enumerate(order):
        unshuffled[i] = shuffled[pos]
    as_tuples = lambda hyps: [(h.tokens, h.score, h.logprob) for h in hyps]  # noqa: E731
    assert [as_tuples(h) for h in alone] == [as_tuples(h) for h in big[:10]]
    assert [as_tuples(h) for h in unshuffled] == [as_tuples(h) for h in big]
    assert len({len(h[0].tokens) for h in big}) > 3  # varied output lengths: compaction happened


def test_batch_invariance_with_two_threads(tiny_model, sources):
    """With 2 threads SDPA's single-query kernel depends on the batch size; search must not use it."""
    few = [s for s in sources if 6 <= len(s) <= 16][:8]  # (slow on a busy CPU: few, short sentences)
    torch.set_num_threads(2)
    try:
        big = search.decode_nbest(tiny_model, few, _cfg(), "cpu", beam=3, nbest=3)
        alone = [search.decode_nbest(tiny_model, [few[i]], _cfg(), "cpu", beam=3, nbest=3)[0] for i in (0, 5)]
    finally:
        torch.set_num_threads(1)
    assert len(few) == 8
    for i, hyps in zip((0, 5), alone):
        assert [(h.tokens, h.score) for h in hyps] == [(h.tokens, h.score) for h in big[i]]


def test_sampling_is_seeded_batch_invariant_and_top_k_1_is_greedy(tiny_model, sources):
    cfg = _cfg(sampling=True, temperature=1.5, top_p=0.9)
    first = search.decode_ids(tiny_model, sources, cfg, "cpu")
    again = [search.decode_ids(tiny_model, [s], cfg, "cpu")[0] for s in sources[:10]]
    assert first[:10] == again
    greedy = search.decode_ids(tiny_model, sources, _cfg(), "cpu", beam=1)
    assert first != greedy  # temperature 1.5 really samples
    assert search.decode_ids(tiny_model, sources, _cfg(sampling=True, temperature=1.5, top_p=0.9, seed=7), "cpu") != first
    assert search.decode_ids(tiny_model, sources, _cfg(sampling=True, top_k=1), "cpu") == greedy


def test_sample_tokens_follows_the_distribution():
    logp = torch.log(torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.3, 0.2]])).expand(4000, 6)
    keys = torch.arange(4000)
    counts = torch.bincount(search.sample_tokens(logp, keys, step=0), minlength=6).double() / 4000
    assert counts[3:].tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    top_p = search.sample_tokens(logp, keys, step=0, top_p=0.6)  # keeps 0.5 and 0.3 only
    assert set(top_p.tolist()) == {3, 4}


def test_decode_ids_input_order_and_training_mode(tiny_model, sources):
    tiny_model.train()
    try:
        ids = search.decode_ids(tiny_model, sources, _cfg(), "cpu", beam=2)
        assert tiny_model.training
    finally:
        tiny_model.eval()
    again = search.decode_ids(tiny_model, sources[::-1], _cfg(), "cpu", beam=2)
    assert ids == again[::-1]
    assert all(EOS_ID not in h and 2 not in h for h in ids)


def test_make_batches_share_one_canonical_length():
    lens = [3, 9, 17, 8, 16, 2, 40, 9]
    batches = search.make_batches(lens, max_tokens=16)
    assert sorted(i for b in batches for i in b) == list(range(len(lens)))
    for b in batches:
        assert len({search.canonical_src_len(lens[i]) for i in b}) == 1
        assert len(b) == 1 or len(b) * search.canonical_src_len(lens[b[0]]) <= 16
    assert isinstance(Hypothesis([1], 0.0, 0.0), Hypothesis)
