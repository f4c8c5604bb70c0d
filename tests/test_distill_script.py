"""scripts/distill.py: the folder it writes, checked against `tcli translate` of the same lines."""

from __future__ import annotations

import gzip
import subprocess
import sys

import pytest

from .conftest import ROOT
from .fixtures_model import env_one_thread, one_thread, smoke_run, tcli  # noqa: F401

PAIRS = 12
DATA_SETS = ["--set", f"data.max_train_pairs={PAIRS}"]


def distill(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "distill.py"), "--config",
                           str(ROOT / "configs" / "smoke.yaml"), "--set", "data.path=data/multi30k", *DATA_SETS,
                           "--quiet", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=env_one_thread(), timeout=600)


def first_lines(path, n):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


@pytest.fixture(scope="module")
def backward_run(tmp_path_factory, multi30k):
    """An en -> de run (10 updates on 200 pairs, 10 validation lines): the back-translation model."""
    root = tmp_path_factory.mktemp("distill")
    for split, count in (("train", 200), ("val", 10), ("test_2016_flickr", 10)):
        for lang in ("de", "en"):
            lines = first_lines(multi30k / f"{split}.{lang}.gz", count)
            (root / f"{split}.{lang}").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    result = tcli("train", "--config", ROOT / "configs" / "smoke.yaml", "--run-dir", root / "en_de", "--quiet",
                  "--set", f"data.path={root}", "--set", "data.src_lang=en", "--set", "data.tgt_lang=de",
                  "--set", "train.max_steps=10", "--set", "train.valid_every=10", "--set", "train.threads=1",
                  timeout=600)
    assert result.returncode == 0, result.stderr
    return root / "en_de"


def translate(run_dir, lines, tmp_path, checkpoint):
    src = tmp_path / "in.txt"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    result = tcli("translate", "--run-dir", run_dir, "-i", src, "--checkpoint", checkpoint, "--quiet")
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_original_forward_and_backward_parts(smoke_run, backward_run, multi30k, tmp_path):  # noqa: F811
    out = tmp_path / "kd"
    result = distill("--out", out, "--teacher", smoke_run, "--backward", backward_run, "--checkpoint", "last")
    assert result.returncode == 0, result.stderr
    de, en = first_lines(multi30k / "train.de.gz", PAIRS), first_lines(multi30k / "train.en.gz", PAIRS)
    got_de = (out / "train.de").read_text(encoding="utf-8").splitlines()
    got_en = (out / "train.en").read_text(encoding="utf-8").splitlines()
    assert len(got_de) == len(got_en) == 3 * PAIRS
    assert got_de[:PAIRS] == de and got_en[:PAIRS] == en  # the original pairs first
    assert got_de[PAIRS:2 * PAIRS] == de
    assert got_en[PAIRS:2 * PAIRS] == translate(smoke_run, de, tmp_path, "last")
    assert got_de[2 * PAIRS:] == translate(backward_run, en, tmp_path, "last")
    assert got_en[2 * PAIRS:] == en
    # the logged lengths: translations' words over the original side's words
    for what, hyp, ref in (("forward", got_en[PAIRS:2 * PAIRS], en), ("backward", got_de[2 * PAIRS:], de)):
        ratio = sum(len(x.split()) for x in hyp) / sum(len(x.split()) for x in ref)
        assert f"{what}: translated {PAIRS} lines" in result.stderr
        assert f"length {ratio:.3f}x the original's, in words" in result.stderr
    for name in ("val.de.gz", "val.en.gz", "test_2016_flickr.de.gz", "test_2016_flickr.en.gz"):
        assert (out / name).resolve() == (multi30k / name).resolve()  # linked, not copied
    # the printed command trains a student on the folder: its data reads as 3 x PAIRS pairs
    command = result.stdout.strip()
    assert f"--set data.path={out}" in command and "data.max_train_pairs=0" in command
    prep = tcli("prepare", "--config", ROOT / "configs" / "smoke.yaml", "--run-dir", tmp_path / "student",
                "--set", f"data.path={out}", "--set", "data.max_train_pairs=0", "--set", "tokenizer.vocab_size=400")
    assert prep.returncode == 0, prep.stderr
    assert f"read train {3 * PAIRS}," in prep.stderr


def test_distilled_only_and_errors(smoke_run, backward_run, tmp_path):  # noqa: F811
    out = tmp_path / "kd"
    result = distill("--out", out, "--teacher", smoke_run, "--no-original", "--checkpoint", "last", "--beam", "1")
    assert result.returncode == 0, result.stderr
    assert len((out / "train.en").read_text(encoding="utf-8").splitlines()) == PAIRS
    # a model of the wrong direction, or nothing to do: one line, exit 2, nothing written
    for args, words in (
        (["--teacher", backward_run], "translates en -> de; it must translate de -> en"),
        (["--backward", smoke_run], "translates de -> en; it must translate en -> de"),
        (["--backward", backward_run, "--no-original"], "--no-original without --teacher"),
        (["--teacher", smoke_run, "--out", "data/multi30k"], "is the config's data.path"),
        (["--teacher", smoke_run, "--set", "data.extra_src_langs=[fr]"], "data.extra_src_langs: distill.py reads"),
        ([], "give --teacher"),
    ):
        bad = distill("--out", tmp_path / "bad", "--checkpoint", "last", *args)  # a later --out wins
        assert bad.returncode == 2, bad.stderr
        assert words in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "bad").exists()
