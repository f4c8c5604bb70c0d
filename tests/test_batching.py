"""Token batches: the max_tokens bound, one pass over every example, determinism, padding, collate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transformer_cli.batching import Batch, collate, split_batches, token_batches
from transformer_cli.config import load_config
from transformer_cli.data import EncodedSplit, Ragged, load_split, prepare
from transformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID
from tests.conftest import ROOT


def random_lens(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 80, n)
    tgt = np.clip(src + rng.integers(-10, 20, n), 1, None)
    return src, tgt


def padded(batches, src, tgt) -> tuple[int, int]:
    return sum(len(b) * int(src[b].max()) for b in batches), sum(len(b) * int(tgt[b].max()) for b in batches)


@pytest.mark.parametrize("max_tokens", [80, 500, 4096])
@pytest.mark.parametrize("shuffle", [True, False])
def test_bound_and_each_example_once(max_tokens, shuffle):
    src, tgt = random_lens(5000, seed=max_tokens)
    batches = token_batches(src, tgt, max_tokens, seed=3, epoch=1, shuffle=shuffle)
    for b in batches:
        fits = len(b) * src[b].max() <= max_tokens and len(b) * tgt[b].max() <= max_tokens
        assert fits or (len(b) == 1 and max(src[b[0]], tgt[b[0]]) > max_tokens)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(len(src)))
    over = int((np.maximum(src, tgt) > max_tokens).sum())
    assert sum(len(b) == 1 and max(src[b[0]], tgt[b[0]]) > max_tokens for b in batches) == over


def test_batches_are_greedy_not_tiny():
    # A trivially "correct" batcher could put every example alone; ours fills batches up.
    src = tgt = np.full(1000, 10)
    batches = token_batches(src, tgt, 100, seed=0, epoch=0)
    assert [len(b) for b in batches] == [10] * 100


def test_same_seed_and_epoch_same_batches_other_epoch_other_order():
    src, tgt = random_lens(3000, seed=7)
    a = token_batches(src, tgt, 1000, seed=5, epoch=2)
    b = token_batches(src, tgt, 1000, seed=5, epoch=2)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    for other in (token_batches(src, tgt, 1000, seed=5, epoch=3), token_batches(src, tgt, 1000, seed=6, epoch=2)):
        assert not np.array_equal(np.concatenate(a), np.concatenate(other))


def test_unshuffled_batches_are_length_sorted_and_fixed():
    src, tgt = random_lens(2000, seed=1)
    a = token_batches(src, tgt, 700, seed=1, epoch=0, shuffle=False)
    b = token_batches(src, tgt, 700, seed=9, epoch=4, shuffle=False)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    longest = np.maximum(src, tgt)[np.concatenate(a)]
    assert np.all(np.diff(longest) >= 0)


def test_example_longer_than_max_tokens_goes_alone():
    src = np.array([5, 5, 300, 5, 5, 5])
    tgt = np.array([5, 5, 10, 5, 400, 5])
    batches = token_batches(src, tgt, 50, seed=0, epoch=0)
    alone = [b.tolist() for b in batches if len(b) == 1]
    assert [2] in alone and [4] in alone
    for b in batches:
        if len(b) > 1:
            assert len(b) * max(src[b].max(), tgt[b].max()) <= 50
    assert sorted(np.concatenate(batches).tolist()) == list(range(6))


def test_empty_and_bad_input():
    assert token_batches([], [], 100, 0, 0) == []
    with pytest.raises(ValueError):
        token_batches([1, 2], [1], 100, 0, 0)


def ragged(rows) -> Ragged:
    return Ragged.from_lists(rows)


def test_collate_matches_a_plain_python_reference():
    rng = np.random.default_rng(0)
    src_rows = [rng.integers(4, 50, rng.integers(0, 9)).tolist() for _ in range(20)]
    tgt_rows = [rng.integers(4, 50, rng.integers(0, 9)).tolist() for _ in range(20)]
    split = EncodedSplit(ragged(src_rows), ragged(tgt_rows), _text={"src": [], "tgt": []})
    index = np.array([7, 0, 13, 2, 19])
    batch = collate(split, index)

    def pad(rows):
        width = max(map(len, rows))
        return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows])

    assert torch.equal(batch.src, pad([src_rows[i] + [EOS_ID] for i in index]))
    assert torch.equal(batch.tgt_in, pad([[BOS_ID] + tgt_rows[i] for i in index]))
    assert torch.equal(batch.tgt_out, pad([tgt_rows[i] + [EOS_ID] for i in index]))
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.int64
    assert batch.src_lens.tolist() == [len(src_rows[i]) + 1 for i in index]
    assert batch.tgt_lens.tolist() == [len(tgt_rows[i]) + 1 for i in index]
    assert batch.num_tgt_tokens == int((batch.tgt_out != PAD_ID).sum())
    assert batch.index.tolist() == index.tolist() and len(batch) == 5
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.src, batch.src)


def test_ragged_select_equals_indexing():
    rows = [[1, 2, 3], [], [4], [5, 6]]
    r = ragged(rows)
    assert [x.tolist() for x in r] == rows and len(r) == 4 and r[-1].tolist() == [5, 6]
    picked = r.select(np.array([3, 1, 0]))
    assert [x.tolist() for x in picked] == [[5, 6], [], [1, 2, 3]]
    joined = Ragged.concat([ragged(rows[:1]), ragged(rows[1:3]), ragged(rows[3:])])
    assert [x.tolist() for x in joined] == rows and joined.flat.dtype == np.int32


@pytest.fixture(scope="module")
def multi30k_train(tmp_path_factory, multi30k) -> EncodedSplit:
    """Multi30k train encoded with the de-en config's joint vocabulary (BPE: trains in a second)."""
    cfg = load_config(ROOT / "configs" / "multi30k_de_en.yaml", [f"data.path={multi30k}", "tokenizer.model_type=bpe"])
    run_dir = tmp_path_factory.mktemp("m30k")
    prepare(cfg, run_dir, quiet=True)
    return load_split(run_dir, "train")


def test_padding_under_ten_percent_on_multi30k(multi30k_train):
    split = multi30k_train
    src, tgt = split.src_lens + 1, split.tgt_lens + 1
    for epoch in range(3):
        batches = split_batches(split, 4096, seed=1, epoch=epoch)
        p_src, p_tgt = padded(batches, src, tgt)
        assert max(len(b) * max(src[b].max(), tgt[b].max()) for b in batches) <= 4096
        assert 1 - src.sum() / p_src < 0.10, "source padding"
        assert 1 - tgt.sum() / p_tgt < 0.10, "target padding"
        assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(len(split)))


def test_collate_on_multi30k_rebuilds_the_ids(multi30k_train):
    split = multi30k_train
    batch = collate(split, split_batches(split, 2048, seed=1, epoch=0)[0])
    for row, i in enumerate(batch.index):
        n = len(split.src[i])
        assert batch.src[row, :n].tolist() == split.src[i].tolist() and batch.src[row, n] == EOS_ID
        assert batch.tgt_out[row, : len(split.tgt[i])].tolist() == split.tgt[i].tolist()
