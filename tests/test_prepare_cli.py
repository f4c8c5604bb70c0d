"""`tcli prepare` through the CLI: the report, the cache, --quiet, and every data error with exit code 2."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import ROOT, run_tcli

SMOKE = ROOT / "configs" / "smoke.yaml"
FAST = ["--set", "data.max_train_pairs=400", "--set", "tokenizer.model_type=bpe", "--set", "tokenizer.vocab_size=500"]


def prepare(run_dir, *extra):
    return run_tcli("prepare", "--config", SMOKE, "--run-dir", run_dir, *FAST, *extra)


def test_prepare_reports_then_second_run_does_nothing(tmp_path):
    first = prepare(tmp_path, "--json")
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout)
    assert not summary["cached"] and summary["tokenizer"] == "trained" and summary["src_vocab_size"] == 500
    assert summary["splits"]["train"]["lines"] == 400
    assert summary["splits"]["valid"] == {**summary["splits"]["valid"], "lines": 1014, "pairs": 1014}
    assert "prepare: read train 400" in first.stderr
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["data"]["max_train_pairs"] == 400 and saved["run_dir"] == str(tmp_path)
    stamp = (tmp_path / "data" / "train.npz").stat().st_mtime_ns

    second = prepare(tmp_path)
    assert second.returncode == 0, second.stderr
    assert "nothing to do" in second.stderr and "cached (nothing to do)" in second.stdout
    assert (tmp_path / "data" / "train.npz").stat().st_mtime_ns == stamp

    changed = prepare(tmp_path, "--set", "data.max_len=20", "--quiet")
    assert changed.returncode == 0 and changed.stderr == ""
    assert "tokenizer reused" in changed.stdout


def write_corpus(folder, train=("Ein Hund.", "Eine Katze.", "Ein Haus."), en=None, val=("Ja.",), val_en=None):
    """Tiny Multi30k-shaped text corpus (plain files)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"train.de": train, "train.en": en if en is not None else ["A dog.", "A cat.", "A house."][:len(train)],
             "val.de": val, "val.en": val_en if val_en is not None else ["Yes."] * len(val),
             "test_2016_flickr.de": ("Nein.",), "test_2016_flickr.en": ("No.",)}
    for name, lines in files.items():
        data = lines if isinstance(lines, bytes) else "".join(x + "\n" for x in lines).encode()
        (folder / name).write_bytes(data)
    return folder


def prepare_data(folder, run_dir, *extra):
    return run_tcli("prepare", "--config", SMOKE, "--run-dir", run_dir, "--set", f"data.path={folder}",
                    "--set", "data.download=false", *extra)


def assert_user_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in result.stderr
    for needle in needles:
        assert needle in last, last


def test_line_count_mismatch(tmp_path):
    folder = write_corpus(tmp_path / "d", en=["A dog.", "A cat."])
    assert_user_error(prepare_data(folder, tmp_path / "run"), "train.de has 3 lines", "train.en has 2 lines")


def test_invalid_utf8_names_file_and_line(tmp_path):
    folder = write_corpus(tmp_path / "d")
    (folder / "train.en").write_bytes(b"A dog.\nA \xff cat.\nA house.\n")
    assert_user_error(prepare_data(folder, tmp_path / "run"), "train.en: line 2 is not valid UTF-8")


def test_empty_split(tmp_path):
    folder = write_corpus(tmp_path / "d", val=(), val_en=())
    assert_user_error(prepare_data(folder, tmp_path / "run"), "the valid split ('val') is empty")


def test_missing_file(tmp_path):
    folder = write_corpus(tmp_path / "d")
    (folder / "test_2016_flickr.en").unlink()
    assert_user_error(prepare_data(folder, tmp_path / "run"), "test_2016_flickr.en: file not found")


def test_missing_multi30k_without_network_says_where_to_put_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TCLI_MULTI30K_URL", "http://127.0.0.1:9/")  # nothing listens on port 9
    result = run_tcli("prepare", "--config", SMOKE, "--run-dir", tmp_path / "run", "--set", f"data.path={tmp_path / 'm'}")
    assert_user_error(result, "download failed", "put the Multi30k task-1 files", f"in {tmp_path / 'm'}")


def test_missing_multi30k_is_downloaded(tmp_path, monkeypatch, multi30k):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in ("train", "val", "test_2016_flickr"):
        for lang in ("de", "en"):
            (mirror / f"{name}.{lang}.gz").write_bytes((multi30k / f"{name}.{lang}.gz").read_bytes())
    monkeypatch.setenv("TCLI_MULTI30K_URL", mirror.as_uri())
    result = prepare(tmp_path / "run", "--set", f"data.path={tmp_path / 'data'}")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(p.name for p in mirror.iterdir())
    assert "downloading Multi30k" in result.stderr


def test_all_lines_empty_in_train(tmp_path):
    folder = write_corpus(tmp_path / "d", train=("", " ", ""), en=("A.", "", "B."))
    assert_user_error(prepare_data(folder, tmp_path / "run"), "no training pairs left after dropping empty lines")


def test_vocab_size_too_large_names_the_key(tmp_path):
    folder = write_corpus(tmp_path / "d")
    assert_user_error(prepare_data(folder, tmp_path / "run"), "tokenizer.vocab_size' (1000) is too large")


def test_corrupt_tokenizer_model(tmp_path):
    assert prepare(tmp_path).returncode == 0
    (tmp_path / "tokenizer" / "joint.model").write_bytes(b"\x00garbage")
    # A data-only change reuses (so loads) the tokenizer.
    assert_user_error(prepare(tmp_path, "--set", "data.max_len=30"), "joint.model: not a sentencepiece model")


def test_bad_jsonl_and_tsv_through_the_cli(tmp_path):
    for split in ("val", "test_2016_flickr"):
        (tmp_path / f"{split}.jsonl").write_text('{"de": "Ja.", "en": "Yes."}\n')
    (tmp_path / "train.jsonl").write_text('{"de": "a", "en": "b"}\nnot json\n')
    result = prepare_data(tmp_path, tmp_path / "run", "--set", "data.format=jsonl")
    assert_user_error(result, "train.jsonl: line 2 is not valid JSON")
    (tmp_path / "train.tsv").write_text("de\ten\nHallo\tHello\n")
    (tmp_path / "test_2016_flickr.tsv").write_text("de\ten\nNein\tNo\n")
    assert_user_error(prepare_data(tmp_path, tmp_path / "run", "--set", "data.format=tsv"), "val.tsv: file not found")
    (tmp_path / "val.tsv").write_bytes(b"de\ten\nJa\tYes\n\xe4\tno\n")  # Latin-1, not UTF-8
    assert_user_error(prepare_data(tmp_path, tmp_path / "run", "--set", "data.format=tsv"), "val.tsv: line 3 is not valid UTF-8")


@pytest.mark.parametrize("bad, message", [
    ("data.format=csv", "key 'data.format' must be one of"),
    ("tokenizer.vocab_size=3", "key 'tokenizer.vocab_size' (3) must exceed"),
])
def test_config_errors(tmp_path, bad, message):
    assert_user_error(prepare(tmp_path, "--set", bad), message)


def test_quiet_silences_datasets_progress_bars(tmp_path, multi30k):
    from transformer_cli.data import read_lines

    for split, (lo, hi) in {"train": (0, 300), "val": (300, 330), "test_2016_flickr": (330, 360)}.items():
        de, en = (read_lines(multi30k / f"train.{lang}.gz")[lo:hi] for lang in ("de", "en"))
        (tmp_path / f"{split}.tsv").write_text("de\ten\n" + "".join(f"{s}\t{t}\n" for s, t in zip(de, en)))
    args = ("--set", "data.format=tsv", "--set", "tokenizer.model_type=bpe", "--set", "tokenizer.vocab_size=400")
    loud = prepare_data(tmp_path, tmp_path / "loud", *args)
    assert loud.returncode == 0, loud.stderr
    assert "prepare: read train 300" in loud.stderr
    assert "Generating train split" in loud.stderr  # datasets' own bars go to stderr...
    quiet = prepare_data(tmp_path, tmp_path / "quiet", *args, "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and "train       300 lines" in quiet.stdout  # ...not here
