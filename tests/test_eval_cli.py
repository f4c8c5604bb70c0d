"""`tcli eval` (equal to the sacrebleu CLI on the files it writes) and `tcli attention` pictures."""

from __future__ import annotations

import json

import pytest

from transformer_cli.cli import main

from .fixtures_model import one_thread, smoke_run, tcli  # noqa: F401
from .test_metrics import sacrebleu_cli


def run_main(capsys, *args) -> tuple[int, str, str]:
    """cli.main in-process: (exit code, stdout, stderr)."""
    code = 0
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_eval_split_equals_sacrebleu_cli(smoke_run, one_thread, capsys):  # noqa: F811
    code, out, err = run_main(capsys, "eval", "--run-dir", smoke_run, "--split", "test", "--json", "--quiet",
                              "--beam", 1)
    assert code == 0, err
    scores = json.loads(out)
    # beam 1 is not the run's decode.beam (2), so the file name says so
    hyp, ref = smoke_run / "hyps" / "test.best.beam1.txt", smoke_run / "hyps" / "test.ref.txt"
    assert scores["hyp_file"] == str(hyp) and scores["num_sentences"] == 1000
    assert len(hyp.read_text(encoding="utf-8").split("\n")) == 1001
    bleu, chrf = sacrebleu_cli(ref, hyp, "-m", "bleu", "chrf")
    (bleu_lc,) = sacrebleu_cli(ref, hyp, "-m", "bleu", "--lowercase")
    for key, cli in (("bleu", bleu), ("chrf", chrf), ("bleu_lc", bleu_lc)):
        assert round(scores[key], 6) == pytest.approx(cli["score"], abs=1e-6), key
        assert scores[f"{key}_signature"] == cli["signature"]
    assert scores["bleu"] > 0.0  # the smoke model gets some n-grams right
    # the split is also scored as published Multi30k figures are, in the run's target language (en)
    from transformer_cli.metrics import read_lines, tok_lc_bleu

    tok_lc, signature = tok_lc_bleu(read_lines(hyp), read_lines(ref), "en")
    assert scores["bleu_tok_lc"] == pytest.approx(tok_lc.score) and scores["bleu_tok_lc_signature"] == signature
    saved = json.loads((smoke_run / "scores.json").read_text(encoding="utf-8"))
    assert saved["test.best.beam1"]["bleu"] == scores["bleu"]
    # the table names every metric with its signature
    code, out, _ = run_main(capsys, "eval", "--hyp", hyp, "--ref", ref)
    assert code == 0 and "BLEU" in out and "chrF" in out and bleu["signature"] in out and "Moses" not in out
    code, out, _ = run_main(capsys, "eval", "--hyp", hyp, "--ref", ref, "--lang", "en", "--json")
    assert code == 0 and json.loads(out)["bleu_tok_lc"] == pytest.approx(scores["bleu_tok_lc"])


def test_other_search_settings_write_beside_not_over(smoke_run, one_thread, capsys):  # noqa: F811
    """A second eval of one checkpoint with another --alpha keeps the first one's hypotheses and scores."""
    hyps = smoke_run / "hyps"
    code, out, err = run_main(capsys, "eval", "--run-dir", smoke_run, "--split", "valid", "--json", "--quiet",
                              "--beam", 2)  # the run's own decode.beam: the plain name
    assert code == 0, err
    plain = json.loads(out)
    assert plain["hyp_file"] == str(hyps / "valid.best.txt")
    before = (hyps / "valid.best.txt").read_bytes()
    code, out, err = run_main(capsys, "eval", "--run-dir", smoke_run, "--split", "valid", "--json", "--quiet",
                              "--alpha", 3.0)
    assert code == 0, err
    other = json.loads(out)
    assert other["hyp_file"] == str(hyps / "valid.best.alpha3.txt") and other["alpha"] == 3.0
    assert (hyps / "valid.best.txt").read_bytes() == before
    saved = json.loads((smoke_run / "scores.json").read_text(encoding="utf-8"))
    assert saved["valid.best"]["alpha"] == 0.6 and saved["valid.best"]["bleu"] == plain["bleu"]
    assert saved["valid.best.alpha3"]["alpha"] == 3.0 and saved["valid.best.alpha3"]["bleu"] == other["bleu"]


def test_search_label_names_only_what_differs_from_the_run():
    import torch

    from transformer_cli.config import DecodeConfig
    from transformer_cli.device import resolve_precision
    from transformer_cli.translator import search_label

    cpu = torch.device("cpu")
    base = DecodeConfig(beam=5, alpha=0.6, precision="fp32")
    assert search_label(base, DecodeConfig(beam=5, alpha=0.6, precision="fp32", max_tokens=100, threads=1), cpu) == ""
    assert search_label(base, DecodeConfig(beam=1, alpha=1.5, precision="bf16"), cpu) == ".beam1.alpha1.5.bf16"
    assert search_label(base, DecodeConfig(beam=5, alpha=1.0), cpu) == ".alpha1"
    # a run trained and configured for a GPU (fp16) is evaluated on a CPU with --precision fp32
    assert search_label(DecodeConfig(precision="fp16"), DecodeConfig(precision="fp32"), cpu) == ".fp32"
    # auto names whatever this CPU resolves it to, so choosing that explicitly adds nothing
    auto = resolve_precision("auto", cpu, "decode.precision")[0]
    other = "fp32" if auto == "bf16" else "bf16"
    assert search_label(DecodeConfig(precision="auto"), DecodeConfig(precision=auto), cpu) == ""
    assert search_label(DecodeConfig(precision="auto"), DecodeConfig(precision=other), cpu) == f".{other}"


def test_eval_files_line_mismatch_and_option_errors(tmp_path, capsys):
    hyp, ref = tmp_path / "h.txt", tmp_path / "r.txt"
    hyp.write_text("a b c\n", encoding="utf-8")
    ref.write_text("a b c\nd e\n", encoding="utf-8")
    code, _, err = run_main(capsys, "eval", "--hyp", hyp, "--ref", ref)
    assert code == 2 and "h.txt has 1 lines" in err and "r.txt has 2" in err
    code, _, err = run_main(capsys, "eval", "--hyp", hyp)
    assert code == 2 and "--ref" in err
    code, _, err = run_main(capsys, "eval", "--run-dir", tmp_path, "--split", "train")
    assert code == 2 and "--split" in err
    code, _, err = run_main(capsys, "eval", "--run-dir", tmp_path, "--lang", "de")
    assert code == 2 and "--lang goes with --hyp/--ref" in err


def test_only_newline_ends_a_line_as_in_sacrebleu(tmp_path, capsys):
    """A lone \r inside a sentence stays in it (CRLF endings are still stripped): no false line-count mismatch."""
    from transformer_cli.metrics import read_lines

    hyp, ref = tmp_path / "h.txt", tmp_path / "r.txt"
    hyp.write_bytes(b"a man\rrides a bike\r\ntwo dogs\r\n")
    ref.write_bytes(b"a man\rrides a bike\ntwo dogs\n")
    assert read_lines(hyp) == read_lines(ref) == ["a man\rrides a bike", "two dogs"]
    code, out, err = run_main(capsys, "eval", "--hyp", hyp, "--ref", ref, "--json")
    assert code == 0, err
    assert json.loads(out)["bleu"] == pytest.approx(100.0)


def test_attention_png(smoke_run, tmp_path):  # noqa: F811
    out = tmp_path / "att.png"
    r = tcli("attention", "--run-dir", smoke_run, "--text", "Ein Mann fährt Fahrrad.", "-o", out, "--heads",
             "--layer", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_attention_weights_and_layer_errors(smoke_run, one_thread, tmp_path, capsys):  # noqa: F811
    from transformer_cli import Translator
    from transformer_cli.translator import draw_attention

    t = Translator.from_run_dir(smoke_run)
    info = t.attention("Ein Mann fährt Fahrrad.")
    S, T = len(info["src_pieces"]), len(info["tgt_pieces"])
    for w in info["cross"]:
        assert w.shape == (4, T, S)
        assert w.sum(-1).sub(1).abs().max() < 1e-5  # each target position's weights sum to 1
    assert info["encoder"][0].shape == (4, S, S)
    path, _ = draw_attention(t, "Ein Mann fährt Fahrrad.", tmp_path / "enc.png", encoder=True)
    assert path.read_bytes()[:4] == b"\x89PNG"
    code, _, err = run_main(capsys, "attention", "--run-dir", smoke_run, "--text", "Ein Hund.", "--layer", "7",
                            "-o", tmp_path / "x.png")
    assert code == 2 and "--layer" in err
