"""`tcli translate` and the Translator API on a trained smoke model: batch invariance on the Multi30k
test set, input order, empty lines, streaming through a real pipe, n-best, errors."""

from __future__ import annotations

import dataclasses
import gzip
import io
import queue
import random
import subprocess
import sys
import threading

import pytest

from transformer_cli import Translator
from transformer_cli.cli import main
from transformer_cli.search import decode_nbest

from .conftest import ROOT, run_tcli
from .fixtures_model import env_one_thread, one_thread, smoke_run, tcli  # noqa: F401


@pytest.fixture(scope="module")
def translator(smoke_run, one_thread):  # noqa: F811
    return Translator.from_run_dir(smoke_run)


@pytest.fixture(scope="module")
def test_lines(multi30k) -> list[str]:
    with gzip.open(multi30k / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def test_batch_invariance_on_multi30k_test(translator, test_lines):
    """Every other test sentence (500, all lengths) in big token batches, in small shuffled batches and
    one per batch: identical n-best lists, scores to the last bit."""
    cfg = translator.decode_cfg
    assert cfg.beam == 2  # configs/smoke.yaml: beam search, not greedy
    ids = translator.encode(test_lines[::2])  # half the set: at 1,000 this was the suite's slowest test (38 s)
    model, device = translator.model, translator.device
    big = decode_nbest(model, ids, cfg, device, nbest=2)
    order = list(range(len(ids)))
    random.Random(0).shuffle(order)
    small = decode_nbest(model, [ids[i] for i in order], dataclasses.replace(cfg, max_tokens=64), device, nbest=2)
    every5 = order[::5]  # one sentence per batch is slow: a random fifth of the set
    alone = decode_nbest(model, [ids[i] for i in every5], dataclasses.replace(cfg, max_tokens=1), device, nbest=2)
    as_tuples = lambda hyps: [(h.tokens, h.score, h.logprob) for h in hyps]  # noqa: E731
    differ = [i for i, h in zip(order, small) if as_tuples(h) != as_tuples(big[i])]
    differ += [i for i, h in zip(every5, alone) if as_tuples(h) != as_tuples(big[i])]
    assert differ == [], f"{len(differ)} decodings differ from the big-batch ones, first {differ[:5]}"
    lengths = {len(h[0].tokens) for h in big}
    assert len(lengths) > 5  # outputs of many lengths: finished sentences were compacted out


def test_order_kept_and_empty_lines_round_trip(translator, test_lines):
    lines = [test_lines[40], "", test_lines[3], "   ", test_lines[17][:12], test_lines[200], ""]
    out = translator.translate(lines)
    assert len(out) == len(lines)
    assert out[1] == out[3] == out[6] == ""
    for line, hyp in zip(lines, out):
        if line.strip():
            assert hyp == translator.translate([line])[0] != ""


def test_cli_file_to_file_matches_api_and_nbest(translator, test_lines, smoke_run, tmp_path):  # noqa: F811
    lines = test_lines[:12] + [""] + test_lines[12:20]
    src = tmp_path / "in.de"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.en"
    r = tcli("translate", "--run-dir", smoke_run, "-i", src, "-o", out, "--buffer-size", 5, "--max-tokens", 64,
             "--threads", 1)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""  # results go to the file only
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == translator.translate(lines)
    r = tcli("translate", "--run-dir", smoke_run, "-i", src, "--beam", 2, "--nbest", 2, "--quiet")
    assert r.returncode == 0, r.stderr
    rows = r.stdout.split("\n")[:-1]
    assert len(rows) == len(lines) and rows[12] == ""
    for row in rows[:12]:
        hyp1, score1, hyp2, score2 = row.split("\t")
        assert float(score1) >= float(score2) and hyp1 != hyp2 or float(score1) > float(score2)


def test_stdin_stdout_pipeline_streams(smoke_run, test_lines):  # noqa: F811
    """With --buffer-size 1 the first translation arrives before stdin is closed."""
    proc = subprocess.Popen([sys.executable, "-m", "transformer_cli", "translate", "--run-dir", str(smoke_run),
                             "--buffer-size", "1", "--beam", "1"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env_one_thread())
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, b"")], daemon=True).start()
    try:
        proc.stdin.write((test_lines[0] + "\n").encode())
        proc.stdin.flush()
        first = lines.get(timeout=120)  # stdin is still open here
        assert first.strip()
        proc.stdin.write(("\n" + test_lines[1] + "\n").encode())
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    finally:
        proc.kill()
    rest = [lines.get(timeout=10) for _ in range(2)]
    assert rest[0] == b"\n" and rest[1].strip()
    r = tcli("translate", "--run-dir", smoke_run, "--beam", 1, input=f"{test_lines[0]}\n\n{test_lines[1]}\n")
    assert r.stdout.encode() == first + b"".join(rest)  # the same as a one-shot pipe


def test_invalid_utf8_names_the_line(smoke_run):  # noqa: F811
    r = tcli("translate", "--run-dir", smoke_run, "--buffer-size", 1, input=b"Ein Mann.\nEin \xff Hund.\n")
    assert r.returncode == 2
    assert "line 2" in r.stderr.decode() and "UTF-8" in r.stderr.decode()
    assert "Traceback" not in r.stderr.decode()


def test_overlong_input_truncated_with_warning(translator, smoke_run, test_lines):  # noqa: F811
    long_line = " ".join([test_lines[0]] * 40)  # far beyond model.max_len subwords
    r = tcli("translate", "--run-dir", smoke_run, "--beam", 1, input=f"{test_lines[1]}\n{long_line}\n")
    assert r.returncode == 0, r.stderr
    assert "line 2" in r.stderr and "truncated" in r.stderr and "line 1" not in r.stderr
    assert len(r.stdout.split("\n")) == 3
    assert len(translator.encode([long_line], warn=None)[0]) == translator.max_src_tokens


def test_user_errors_exit_2(smoke_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Ein Mann.\n")))
    cases = [
        (["--run-dir", tmp_path / "nothing"], "config.yaml"),
        (["--run-dir", smoke_run, "--checkpoint", "averaged"], "averaged"),
        (["--run-dir", smoke_run, "--beam", 2, "--nbest", 3], "--nbest"),
        (["--run-dir", smoke_run, "--beam", 0], "decode.beam"),
        (["--run-dir", smoke_run, "-i", tmp_path / "missing.txt"], "missing.txt"),
        (["--run-dir", smoke_run, "--set", "train.lr=3"], "decode.*"),
        (["--run-dir", smoke_run, "--set", "decode.top_p=abc"], "decode.top_p"),
        (["--run-dir", smoke_run, "--device", "cpu", "--precision", "fp16"], "'decode.precision' is fp16"),
    ]
    for args, word in cases:  # in-process through cli.main: the same error path, no interpreter start
        with pytest.raises(SystemExit) as exit_info:
            main(["translate", *map(str, args)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, (args, err)
        assert err.startswith("error: ") and word in err, (args, err)


def test_python_api_from_run_dir(smoke_run, one_thread):  # noqa: F811
    t = Translator.from_run_dir(smoke_run, checkpoint="last", decode={"beam": 1})
    assert t.decode_cfg.beam == 1 and t.checkpoint.parent.name == "last"
    out = t.translate(["Ein Hund läuft.", ""])
    assert out[0] and out[1] == ""
    # precision auto is resolved for the device once, and decodes as what it resolved to
    from transformer_cli.device import resolve_precision

    auto = Translator.from_run_dir(smoke_run, checkpoint="last", decode={"beam": 1, "precision": "auto"})
    resolved = resolve_precision("auto", auto.device, "decode.precision")[0]
    assert auto.decode_cfg.precision == resolved and resolved in ("bf16", "fp32")
    explicit = Translator.from_run_dir(smoke_run, checkpoint="last", decode={"beam": 1, "precision": resolved})
    assert auto.translate(["Ein Hund läuft."]) == explicit.translate(["Ein Hund läuft."])
    assert run_tcli("translate", "--help").returncode == 0


def test_seeded_sampling_through_the_cli(smoke_run, one_thread, tmp_path, capsys):  # noqa: F811
    src = tmp_path / "in.de"
    src.write_text("Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\n", encoding="utf-8")
    outs = []
    for seed in (1, 1, 2):
        with pytest.raises(SystemExit) as exit_info:
            main(["translate", "--run-dir", str(smoke_run), "-i", str(src), "--sampling", "--quiet",
                  "--set", "decode.temperature=2.0", "--set", f"decode.seed={seed}"])
        assert exit_info.value.code in (0, None)
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2]
    assert len(outs[0].split("\n")) == 3

