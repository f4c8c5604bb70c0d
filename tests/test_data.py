"""Data sources, cleaning and the prepare cache (library level; the CLI errors are in test_prepare_cli.py)."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from transformer_cli.config import Config, DataConfig, TokenizerConfig
from transformer_cli.data import (
    clean_text_pairs, length_filter, load_split, normalize, prepare, read_lines, read_pairs,
)
from transformer_cli.errors import DataError
from transformer_cli.tokenizer import Tokenizer

SPLITS = ("train", "validation", "test")
TRICKY = [  # (de, en): quotes, "NA", runs of spaces, an empty side, a duplicate
    ('"Hallo", sagte er.', '"Hello," he said.'),
    ("NA", "null"),
    ("Ein  Hund   rennt .", "A dog  runs ."),
    ("", "An empty source."),
    ("Zwei Hunde.", "Two dogs."),
    ("Zwei Hunde.", "Two dogs."),
    ("Ja.", "Yes, certainly, and at quite some length, as the ratio filter must see."),
]


@pytest.fixture(scope="module")
def pairs(multi30k) -> dict:
    de, en = read_lines(multi30k / "train.de.gz"), read_lines(multi30k / "train.en.gz")
    return {
        "train": TRICKY + list(zip(de[:300], en[:300])),
        "validation": [("", ""), ("NA", "NA")] + list(zip(de[300:340], en[300:340])),
        "test": list(zip(de[340:370], en[340:370])),
    }


@pytest.fixture(scope="module")
def sources(pairs, tmp_path_factory) -> dict:
    """The same pairs as text files, TSV, JSONL, a hub-shaped parquet folder and a wmt14-shaped one."""
    import datasets

    root = tmp_path_factory.mktemp("sources")
    for fmt in ("text", "tsv", "jsonl", "hub_flat", "hub_wmt"):
        (root / fmt).mkdir()
    for split, rows in pairs.items():
        de, en = [r[0] for r in rows], [r[1] for r in rows]
        for lang, lines in (("de", de), ("en", en)):
            data = "".join(x + "\n" for x in lines).encode()
            if split == "train":  # plain for train, gzip for the others: both are read
                (root / "text" / f"{split}.{lang}").write_bytes(data)
            else:
                (root / "text" / f"{split}.{lang}.gz").write_bytes(gzip.compress(data))
        (root / "tsv" / f"{split}.tsv").write_text("de\ten\n" + "".join(f"{s}\t{t}\n" for s, t in rows))
        (root / "jsonl" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"de": s, "en": t}, ensure_ascii=False) + "\n" for s, t in rows))
        datasets.Dataset.from_dict({"de": de, "en": en}).to_parquet(str(root / "hub_flat" / f"{split}.parquet"))
        (root / "hub_wmt" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"translation": {"de": s, "en": t}}) + "\n" for s, t in rows))
    return {
        "text": DataConfig(format="text", path=str(root / "text")),
        "tsv": DataConfig(format="tsv", path=str(root / "tsv")),
        "jsonl": DataConfig(format="jsonl", path=str(root / "jsonl")),
        "hub_flat": DataConfig(format="hub", path=str(root / "hub_flat")),
        "hub_wmt": DataConfig(format="hub", path=str(root / "hub_wmt"), translation_field="translation"),
    }


def with_splits(d: DataConfig, **extra) -> DataConfig:
    for key, value in {"train_split": "train", "valid_split": "validation", "test_split": "test",
                       "download": False, **extra}.items():
        setattr(d, key, value)
    return d


def test_every_source_format_yields_the_same_pairs(pairs, sources):
    for split in SPLITS:
        expected = ([s for s, _ in pairs[split]], [t for _, t in pairs[split]])
        for name, d in sources.items():
            assert read_pairs(d, split) == expected, f"{name} {split}"


def test_named_columns_and_missing_columns(sources, tmp_path):
    (tmp_path / "train.tsv").write_text("id\tgerman\tenglish\n1\tHallo\tHello\n2\tJa\tYes\n")
    d = DataConfig(format="tsv", path=str(tmp_path), src_field="german", tgt_field="english")
    assert read_pairs(d, "train") == (["Hallo", "Ja"], ["Hello", "Yes"])
    d.src_field = "deutsch"
    with pytest.raises(DataError, match="no column 'deutsch'.*columns are id, german, english"):
        read_pairs(d, "train")
    d = DataConfig(**{**vars(sources["hub_wmt"]), "translation_field": "pairs"})
    with pytest.raises(DataError, match="no column 'pairs'"):
        read_pairs(d, "train")


def test_bad_jsonl_line_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"de": "a", "en": "b"}\n{"de": "c", "en": \n')
    with pytest.raises(DataError, match="train.jsonl: line 2 is not valid JSON"):
        read_pairs(DataConfig(format="jsonl", path=str(tmp_path)), "train")


def test_hub_split_that_does_not_exist(sources):
    with pytest.raises(DataError, match="no split 'dev'"):
        read_pairs(sources["hub_flat"], "dev")


def test_read_lines_keeps_empty_lines_and_only_splits_on_newline(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes("a\n\nb\u2028c\r\nd\re\x85f".encode())  # a lone \r or NEL is part of the sentence
    assert read_lines(path) == ["a", "", "b\u2028c", "d\re\x85f"]


def test_chunked_encoding_equals_one_pass(pairs, tmp_path):
    from transformer_cli.data import _encode
    from transformer_cli.tokenizer import train_tokenizer

    src, tgt = [s for s, _ in pairs["train"]], [t for _, t in pairs["train"]]
    tok = train_tokenizer(TokenizerConfig(model_type="bpe", vocab_size=400), src, tgt, tmp_path)
    for side, whole in zip(_encode(tok, DataConfig(), src, tgt, chunk=7), (tok.encode_src(src), tok.encode_tgt(tgt))):
        assert [x.tolist() for x in side] == whole


def test_normalize_whitespace():
    assert normalize("  Ein \t Hund\u00a0 rennt \n") == "Ein Hund rennt"


def test_text_filters_count_what_they_drop():
    src = ["a", "", "b", "a", "c", "a"]
    tgt = ["x", "y", "", "x", "z", "x"]
    keep, counts = clean_text_pairs(DataConfig(dedup=True), src, tgt)
    assert keep.tolist() == [0, 4] and counts == {"empty": 2, "duplicate": 2}
    keep, counts = clean_text_pairs(DataConfig(dedup=False), src, tgt)
    assert keep.tolist() == [0, 3, 4, 5] and counts == {"empty": 2, "duplicate": 0}


def test_length_filters():
    src, tgt = np.array([5, 10, 10, 2, 1]), np.array([5, 11, 31, 7, 3])
    ok, counts = length_filter(DataConfig(max_len=30, max_ratio=3.0), src, tgt)
    # pair 2 is too long (31 > 30); pair 3 has ratio 3.5 > 3; pair 4 has ratio exactly 3: kept
    assert ok.tolist() == [True, True, False, False, True] and counts == {"too_long": 1, "ratio": 1}
    ok, counts = length_filter(DataConfig(max_len=100, max_ratio=0), src, tgt)
    assert ok.all() and counts == {"too_long": 0, "ratio": 0}


def small_config(d: DataConfig, **tok) -> Config:
    return Config(data=d, tokenizer=TokenizerConfig(model_type="bpe", vocab_size=400, **tok))


def test_prepare_cleans_train_only_and_keeps_valid_test_aligned(sources, pairs, tmp_path):
    d = with_splits(DataConfig(**vars(sources["text"])), dedup=True, max_len=60, max_ratio=2.5)
    summary = prepare(small_config(d), tmp_path, quiet=True)
    tok = Tokenizer.load(tmp_path / "tokenizer")
    # Expected counts, computed here from the rule definitions.
    seen, expected, kept = set(), {"empty": 0, "duplicate": 0, "too_long": 0, "ratio": 0}, []
    for s, t in pairs["train"]:
        ns, nt = normalize(s), normalize(t)
        if not ns or not nt:
            expected["empty"] += 1
            continue
        if (ns, nt) in seen:
            expected["duplicate"] += 1
            continue
        seen.add((ns, nt))
        ls, lt = len(tok.encode_src([ns])[0]), len(tok.encode_tgt([nt])[0])
        if max(ls, lt) > 60:
            expected["too_long"] += 1
        elif max(ls, lt) > 2.5 * min(ls, lt):
            expected["ratio"] += 1
        else:
            kept.append((s, t))
    assert summary["dropped"] == expected and expected["empty"] == 1 and expected["duplicate"] == 1
    assert expected["too_long"] > 0 and expected["ratio"] > 0
    train = load_split(tmp_path, "train")
    assert list(zip(train.src_text, train.tgt_text)) == kept
    assert tok.decode_src(train.src) == [normalize(s) for s, _ in kept]
    for name, split in (("valid", "validation"), ("test", "test")):
        enc = load_split(tmp_path, name)
        assert list(zip(enc.src_text, enc.tgt_text)) == pairs[split]  # every line, the empty one too
        assert [x.tolist() for x in enc.src] == tok.encode_src([normalize(s) for s, _ in pairs[split]])
        assert enc.src.flat.dtype == np.int32
    assert len(load_split(tmp_path, "valid").src[0]) == 0


def test_hub_and_text_sources_prepare_to_identical_arrays(sources, tmp_path):
    for name in ("text", "hub_wmt"):
        prepare(small_config(with_splits(DataConfig(**vars(sources[name]))), seed=2), tmp_path / name, quiet=True)
    for split in ("train", "valid", "test"):
        a, b = load_split(tmp_path / "text", split), load_split(tmp_path / "hub_wmt", split)
        assert np.array_equal(a.src.flat, b.src.flat) and np.array_equal(a.tgt.offsets, b.tgt.offsets)


def test_cache_reuse_and_rebuild(sources, tmp_path):
    d = with_splits(DataConfig(**vars(sources["text"])))
    cfg = small_config(d)
    first = prepare(cfg, tmp_path, quiet=True)
    assert not first["cached"] and first["tokenizer"] == "trained"
    npz = tmp_path / "data" / "train.npz"
    stamp = npz.stat().st_mtime_ns
    again = prepare(cfg, tmp_path, quiet=True)
    assert again["cached"] and npz.stat().st_mtime_ns == stamp
    assert {k: v for k, v in again.items() if k not in ("cached", "seconds")} == \
           {k: v for k, v in first.items() if k not in ("cached", "seconds")}

    # Touching a file (same content) is still a cache hit; a changed line rebuilds.
    data_file = os.path.join(d.path, "train.de")
    os.utime(data_file, ns=(1, 10**18))
    assert prepare(cfg, tmp_path, quiet=True)["cached"]
    # A setting that does not change the tokenizer's text re-encodes with the same tokenizer.
    cfg.data.max_len = 20
    rebuilt = prepare(cfg, tmp_path, quiet=True)
    assert not rebuilt["cached"] and rebuilt["tokenizer"] == "reused"
    assert rebuilt["splits"]["train"]["pairs"] < first["splits"]["train"]["pairs"]
    cfg.tokenizer.vocab_size = 450
    rebuilt = prepare(cfg, tmp_path, quiet=True)
    assert rebuilt["tokenizer"] == "trained" and rebuilt["src_vocab_size"] == 450
    assert prepare(cfg, tmp_path, quiet=True)["cached"]
    original = open(data_file, encoding="utf-8").read()
    try:
        with open(data_file, "w", encoding="utf-8") as f:
            f.write(original.replace("Zwei", "Drei", 1))
        assert not prepare(cfg, tmp_path, quiet=True)["cached"]
    finally:
        with open(data_file, "w", encoding="utf-8") as f:
            f.write(original)


def test_max_train_pairs_and_no_test_split(sources, tmp_path):
    d = with_splits(DataConfig(**vars(sources["jsonl"])), max_train_pairs=100, test_split="")
    summary = prepare(small_config(d), tmp_path, quiet=True)
    assert summary["splits"]["train"]["lines"] == 100 and set(summary["splits"]) == {"train", "valid"}
    with pytest.raises(DataError, match="test split is not prepared"):
        load_split(tmp_path, "test")


@pytest.mark.parametrize("content, message", [
    ('{"de": "a", "en": "b"}\n{"de": 7, "en": "c"}\n', "train.jsonl: line 2: 'de' is int, not text"),
    ('{"de": 1, "en": "b"}\n{"de": 2, "en": "c"}\n', "train.jsonl: column 'de' holds int values, not text"),
    ('{"de": "a", "en": "b"}\n["a", "b"]\n', "train.jsonl: line 2 is not a JSON object"),
])
def test_jsonl_values_must_be_text(tmp_path, content, message):
    (tmp_path / "train.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        read_pairs(DataConfig(format="jsonl", path=str(tmp_path)), "train")


def test_tsv_field_counts_are_checked_and_blank_lines_are_empty_pairs(tmp_path):
    (tmp_path / "train.tsv").write_text("de\ten\nHallo\tHello\n\nNA\tnull\n")
    assert read_pairs(DataConfig(format="tsv", path=str(tmp_path)), "train") == (["Hallo", "", "NA"], ["Hello", "", "null"])
    (tmp_path / "train.tsv").write_text("de\ten\nHallo\tHello\nno tab here\n")
    with pytest.raises(DataError, match="train.tsv: line 3 has 1 tab-separated fields, the header has 2"):
        read_pairs(DataConfig(format="tsv", path=str(tmp_path)), "train")


def test_a_crashed_rebuild_never_passes_for_the_old_cache(sources, tmp_path, monkeypatch):
    import transformer_cli.data as data

    cfg = small_config(with_splits(DataConfig(**vars(sources["text"]))))
    good = prepare(cfg, tmp_path, quiet=True)
    cfg.data.max_len = 20

    save = data._save_split

    def crash(folder, name, *args):
        if name != "train":
            raise KeyboardInterrupt  # killed after the new train split was written
        save(folder, name, *args)

    monkeypatch.setattr(data, "_save_split", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, tmp_path, quiet=True)
    monkeypatch.undo()
    cfg.data.max_len = DataConfig().max_len
    again = prepare(cfg, tmp_path, quiet=True)
    assert not again["cached"] and again["splits"] == good["splits"]
    assert len(load_split(tmp_path, "train")) == good["splits"]["train"]["pairs"]


def test_extra_source_languages_add_training_pairs_for_the_same_targets(sources, pairs, tmp_path):
    import shutil

    folder = tmp_path / "three_way"
    shutil.copytree(sources["text"].path, folder)
    en = [t for _, t in pairs["train"]]
    fr = [f"Traduction {i} : {t.lower()}" for i, t in enumerate(en)]  # a third side, aligned with en
    (folder / "train.fr").write_text("".join(x + "\n" for x in fr), encoding="utf-8")
    d = with_splits(DataConfig(format="text", path=str(folder)), extra_src_langs=["fr"], max_ratio=0.0, max_len=10_000)
    summary = prepare(small_config(d), tmp_path / "run", quiet=True)
    train = load_split(tmp_path / "run", "train")
    kept = lambda rows: [(s, t) for s, t in rows if normalize(s) and normalize(t)]  # noqa: E731
    # the German pairs, then every French line with the English line it is aligned with
    assert list(zip(train.src_text, train.tgt_text)) == kept(pairs["train"]) + kept(zip(fr, en))
    assert summary["splits"]["train"]["lines"] == 2 * len(en)
    tok = Tokenizer.load(tmp_path / "run" / "tokenizer")
    assert len(tok.encode_src(["Traduction"])[0]) == 1  # the tokenizer learned from the French side
    for name, split in (("valid", "validation"), ("test", "test")):  # evaluation stays de -> en
        enc = load_split(tmp_path / "run", name)
        assert list(zip(enc.src_text, enc.tgt_text)) == pairs[split]

    d.max_train_pairs = 5  # the first 5 lines of each source language
    prepare(small_config(d), tmp_path / "run5", quiet=True)
    five = load_split(tmp_path / "run5", "train")
    assert list(zip(five.src_text, five.tgt_text)) == kept(pairs["train"][:5]) + kept(zip(fr[:5], en[:5]))

    (folder / "train.fr").write_text("".join(x + "\n" for x in fr[:-1]), encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.fr has \d+ lines but .*train\.en has \d+ lines"):
        prepare(small_config(d), tmp_path / "run_bad", quiet=True)
    (folder / "train.fr").unlink()
    with pytest.raises(DataError, match=r"train\.fr: file not found"):
        prepare(small_config(d), tmp_path / "run_bad", quiet=True)


@pytest.mark.parametrize("data, message", [
    ({"extra_src_langs": ["de"]}, "distinct language codes other than"),
    ({"extra_src_langs": ["fr", "fr"]}, "distinct language codes other than"),
    ({"extra_src_langs": "fr"}, "must be list"),
    ({"extra_src_langs": ["fr"], "format": "tsv"}, "needs data.format: text"),
])
def test_extra_source_languages_are_checked(data, message):
    from transformer_cli.config import from_dict
    from transformer_cli.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        from_dict({"data": data}, "x.yaml")
