"""Subword regularisation: a sampled segmentation differs from the prepared one and from the next sample,
spells the same text, respects data.max_len, and is saved and reloaded per epoch."""

from __future__ import annotations

import numpy as np
import pytest

from transformer_cli.config import Config, TokenizerConfig, from_dict
from transformer_cli.data import EncodedSplit, Ragged, normalize, read_lines
from transformer_cli.errors import ConfigError, DataError
from transformer_cli.subword import load_sample, mean_growth, sample_path, sampled_split, save_sample
from transformer_cli.tokenizer import Tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def setup(multi30k, tmp_path_factory):
    """A unigram joint tokenizer on 3,000 Multi30k de-en pairs and those pairs as a prepared split."""
    raw_de = read_lines(multi30k / "train.de.gz")[:3000]
    raw_en = read_lines(multi30k / "train.en.gz")[:3000]
    folder = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer(TokenizerConfig(vocab_size=1000), [normalize(x) for x in raw_de],
                          [normalize(x) for x in raw_en], folder)
    src = Ragged.from_lists(tok.encode_src([normalize(x) for x in raw_de]))
    tgt = Ragged.from_lists(tok.encode_tgt([normalize(x) for x in raw_en]))
    return tok, EncodedSplit(src, tgt, _text={"src": raw_de, "tgt": raw_en})  # raw lines, as prepare keeps them


def cfg_with(**train) -> Config:
    return from_dict({"train": {"subword_alpha": 0.1, "subword_nbest": 64, **train}})


def rows(ragged: Ragged) -> list[list[int]]:
    return [ragged[i].tolist() for i in range(len(ragged))]


def test_samples_differ_from_the_prepared_segmentation_and_from_each_other(setup):
    tok, split = setup
    a, b = sampled_split(split, tok, cfg_with()), sampled_split(split, tok, cfg_with())
    for side in ("src", "tgt"):
        fixed, first, second = rows(getattr(split, side)), rows(getattr(a, side)), rows(getattr(b, side))
        assert sum(x != y for x, y in zip(first, fixed)) / len(split) > 0.5
        assert sum(x != y for x, y in zip(first, second)) / len(split) > 0.5


def test_saved_sample_round_trips_and_older_epochs_are_pruned(setup, tmp_path):
    tok, split = setup
    samples = {}
    for epoch in (1, 2, 3, 4):
        samples[epoch] = sampled_split(split, tok, cfg_with())
        save_sample(tmp_path, epoch, samples[epoch])
    names = sorted(p.name for p in (tmp_path / "subword").iterdir())
    assert names == ["epoch_00001.npz", "epoch_00003.npz", "epoch_00004.npz"]  # 1 plans the schedule
    for epoch in (1, 3, 4):
        loaded = load_sample(tmp_path, epoch, split)
        assert rows(loaded.src) == rows(samples[epoch].src) and rows(loaded.tgt) == rows(samples[epoch].tgt)
    assert load_sample(tmp_path, 2, split) is None
    smaller = EncodedSplit(split.src.select(np.arange(10)), split.tgt.select(np.arange(10)))
    with pytest.raises(DataError, match="epoch_00003.npz: holds 3000 pairs but the prepared training split has 10"):
        load_sample(tmp_path, 3, smaller)
    sample_path(tmp_path, 3).write_bytes(b"not a zip")
    with pytest.raises(DataError, match="epoch_00003.npz: cannot read the saved subword sample"):
        load_sample(tmp_path, 3, split)


def test_sample_spells_the_same_text_and_is_longer(setup):
    tok, split = setup
    sample = sampled_split(split, tok, cfg_with())
    assert tok.decode_src(rows(sample.src)) == [normalize(x) for x in split.src_text]
    assert tok.decode_tgt(rows(sample.tgt)) == [normalize(x) for x in split.tgt_text]
    assert 1.02 < mean_growth(split, sample) < 1.5  # a sample uses shorter pieces, not a different alphabet
    sharper = sampled_split(split, tok, cfg_with(subword_alpha=2.0))  # a peaked distribution stays near the best
    assert mean_growth(split, sharper) < mean_growth(split, sample)


def test_pairs_a_sample_makes_too_long_keep_their_prepared_segmentation(setup):
    tok, split = setup
    cfg = cfg_with(subword_nbest=-1, subword_alpha=0.05)  # nearly uniform: about twice the tokens
    cfg.data.max_len = 20
    sample = sampled_split(split, tok, cfg, chunk=700)  # chunks that do not divide the 3,000 pairs
    assert len(sample) == len(split)
    same = [sample.src[i].tolist() == split.src[i].tolist() and sample.tgt[i].tolist() == split.tgt[i].tolist()
            for i in range(len(split))]
    fits = [len(sample.src[i]) <= 20 and len(sample.tgt[i]) <= 20 for i in range(len(split))]
    assert all(f or s for f, s in zip(fits, same))  # a pair over the limit is the prepared one
    fell_back = [i for i in range(len(split)) if same[i] and len(split.src[i]) > 6]
    assert len(fell_back) > 300  # ... which happened often: a near-uniform sample doubles the length


@pytest.mark.parametrize("key, value, words", [
    ("train.subword_alpha", -0.1, ">= 0"),
    ("train.subword_nbest", 0, "-1 (all) or >= 1"),
    ("train.subword_nbest", -2, "-1 (all) or >= 1"),
])
def test_bad_settings_name_the_key(key, value, words):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"'{key}'.*{words.replace('(', '.').replace(')', '.')}"):
        from_dict({section: {name: value}})


def test_bpe_dropout_probability_below_one():
    with pytest.raises(ConfigError, match="'train.subword_alpha' is the BPE-dropout probability"):
        from_dict({"tokenizer": {"model_type": "bpe"}, "train": {"subword_alpha": 1.0}})
    from_dict({"tokenizer": {"model_type": "unigram"}, "train": {"subword_alpha": 1.5}})  # unigram: a sharpness
