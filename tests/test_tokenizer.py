"""Sentencepiece tokenizer: exact round trip, fixed special ids, joint/separate models, clear errors."""

from __future__ import annotations

import json

import pytest

from transformer_cli.config import TokenizerConfig
from transformer_cli.data import normalize, read_lines
from transformer_cli.errors import DataError
from transformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def train_text(multi30k):
    """The smoke config's training text: the first 3,000 Multi30k de-en pairs, normalised."""
    de = [normalize(x) for x in read_lines(multi30k / "train.de.gz")[:3000]]
    en = [normalize(x) for x in read_lines(multi30k / "train.en.gz")[:3000]]
    return de, en


@pytest.fixture(scope="module")
def joint(train_text, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(TokenizerConfig(vocab_size=1000), *train_text, folder)
    return folder


def test_round_trip_on_multi30k_val(joint, multi30k):
    tok = Tokenizer.load(joint)
    for lang, encode in (("de", tok.encode_src), ("en", tok.encode_tgt)):
        lines = [normalize(x) for x in read_lines(multi30k / f"val.{lang}.gz")]
        assert len(lines) == 1014
        ids = encode(lines)
        assert all(i != UNK_ID for row in ids for i in row)  # byte fallback: nothing unknown
        assert tok.decode_tgt(ids) == lines


def test_unseen_characters_survive_through_byte_fallback(joint):
    tok = Tokenizer.load(joint)
    text = "Ein Schneemann ☃ in Zürich, 東京 und Ωmega."
    assert tok.decode_src(tok.encode_src([text])) == [text]


def test_special_ids_are_fixed_and_recorded(joint):
    tok = Tokenizer.load(joint)
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tok.src_pieces([0, 1, 2, 3]) == ["<pad>", "<unk>", "<s>", "</s>"]
    meta = json.loads((joint / "tokenizer.json").read_text())
    assert (meta["pad_id"], meta["unk_id"], meta["bos_id"], meta["eos_id"]) == (0, 1, 2, 3)
    assert tok.joint and tok.src_vocab_size == tok.tgt_vocab_size == meta["src_vocab_size"] == 1000
    ids = tok.encode_tgt(["Zwei Hunde spielen."])[0]
    assert min(ids) > EOS_ID  # encoding adds no specials
    assert tok.decode_tgt([[BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]]) == tok.decode_tgt([ids]) == ["Zwei Hunde spielen."]
    assert "".join(tok.tgt_pieces(ids)).replace("▁", " ").strip() == "Zwei Hunde spielen."


def test_separate_bpe_models(train_text, tmp_path):
    de, en = train_text
    cfg = TokenizerConfig(model_type="bpe", vocab_size=600, joint=False)
    tok = train_tokenizer(cfg, de[:1500], en[:1500], tmp_path)
    assert not tok.joint and {p.name for p in tmp_path.glob("*.model")} == {"src.model", "tgt.model"}
    loaded = Tokenizer.load(tmp_path)
    assert not loaded.joint and loaded.src_vocab_size == loaded.tgt_vocab_size == 600
    # The German model knows German subwords the English one lacks.
    src_vocab = set(loaded.src_pieces(range(600)))
    tgt_vocab = set(loaded.tgt_pieces(range(600)))
    assert "▁und" in src_vocab and "▁and" in tgt_vocab and "▁und" not in tgt_vocab
    assert loaded.decode_src(loaded.encode_src(de[:50])) == de[:50]
    assert loaded.decode_tgt(loaded.encode_tgt(en[:50])) == en[:50]


def test_sampling_is_seeded(train_text, tmp_path):
    de, en = train_text
    cfg = TokenizerConfig(vocab_size=400, input_sentence_size=800, seed=3)
    a = train_tokenizer(cfg, de, en, tmp_path / "a")
    b = train_tokenizer(cfg, de, en, tmp_path / "b")
    assert (tmp_path / "a" / "joint.model").read_bytes() == (tmp_path / "b" / "joint.model").read_bytes()
    cfg.seed = 4
    train_tokenizer(cfg, de, en, tmp_path / "c")
    assert (tmp_path / "c" / "joint.model").read_bytes() != (tmp_path / "a" / "joint.model").read_bytes()
    assert a.src_vocab_size == b.src_vocab_size == 400


def test_not_a_sentencepiece_model_is_a_data_error(joint, tmp_path):
    (tmp_path / "tokenizer.json").write_text((joint / "tokenizer.json").read_text())
    (tmp_path / "joint.model").write_bytes(b"this is not a model\n")
    with pytest.raises(DataError, match="joint.model: not a sentencepiece model"):
        Tokenizer.load(tmp_path)


def test_missing_tokenizer_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="tokenizer.json: no tokenizer there"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("vocab_size, words", [(5000, "too large"), (100, "too small")])
def test_vocab_size_errors_name_the_key(train_text, tmp_path, vocab_size, words):
    de, en = train_text
    with pytest.raises(DataError, match=f"tokenizer.vocab_size' \\({vocab_size}\\) is {words}"):
        train_tokenizer(TokenizerConfig(vocab_size=vocab_size), de[:100], en[:100], tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
