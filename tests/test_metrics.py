"""metrics.py against the sacrebleu command line on the same files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from transformer_cli.errors import DataError
from transformer_cli.metrics import corpus_scores, format_table, score_files

HYPS = ["The cat sat on the mat .", "A dog runs  ", "", "Hello World", "Zwei Männer, die reden."]
REFS = ["the cat sat on a mat.", "A dog is running", "something", "hello world", "Two men talking."]


def sacrebleu_cli(ref, hyp, *extra) -> list[dict]:
    """Scores printed by the sacrebleu CLI (JSON, 6 decimals)."""
    exe = shutil.which("sacrebleu")
    cmd = [exe] if exe else [sys.executable, "-m", "sacrebleu"]
    out = subprocess.run([*cmd, str(ref), "-i", str(hyp), "-w", "6", "-f", "json", *extra],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    return data if isinstance(data, list) else [data]


def test_scores_equal_sacrebleu_cli(tmp_path):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("\n".join(HYPS) + "\n", encoding="utf-8")
    ref.write_text("\n".join(REFS) + "\n", encoding="utf-8")
    scores = score_files(hyp, ref)
    bleu, chrf = sacrebleu_cli(ref, hyp, "-m", "bleu", "chrf")
    (bleu_lc,) = sacrebleu_cli(ref, hyp, "-m", "bleu", "--lowercase")
    assert round(scores["bleu"], 6) == pytest.approx(bleu["score"], abs=1e-6)
    assert round(scores["chrf"], 6) == pytest.approx(chrf["score"], abs=1e-6)
    assert round(scores["bleu_lc"], 6) == pytest.approx(bleu_lc["score"], abs=1e-6)
    assert scores["bleu_signature"] == bleu["signature"]
    assert scores["chrf_signature"] == chrf["signature"]
    assert scores["bleu_lc_signature"] == bleu_lc["signature"]
    assert scores["bleu_lc"] > scores["bleu"]  # casing errors in HYPS only cost cased BLEU
    assert "BLEU" in format_table(scores) and bleu["signature"] in format_table(scores)


def test_perfect_hypotheses_score_100():
    scores = corpus_scores(REFS[:2], REFS[:2])
    assert scores["bleu"] == pytest.approx(100.0) and scores["chrf"] == pytest.approx(100.0)


def test_line_count_mismatch_names_both_files(tmp_path):
    hyp, ref = tmp_path / "h.txt", tmp_path / "r.txt"
    hyp.write_text("a\nb\n", encoding="utf-8")
    ref.write_text("a\nb\nc\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"h\.txt has 2 lines but .*r\.txt has 3"):
        score_files(hyp, ref)


def test_empty_files_are_an_error_not_a_crash(tmp_path):
    hyp, ref = tmp_path / "h.txt", tmp_path / "r.txt"
    hyp.write_text("", encoding="utf-8")
    ref.write_text("", encoding="utf-8")
    with pytest.raises(DataError, match=r"r\.txt is empty; there is nothing to score .*h\.txt against"):
        score_files(hyp, ref)
    with pytest.raises(DataError, match="no sentences to score"):
        corpus_scores([], [])


def test_moses_lc_is_multi30k_preprocessing():
    """Golden strings: lowercase, then normalize-punctuation (curly quotes, spacing), then tokenize."""
    from transformer_cli.metrics import moses_lc

    assert moses_lc(["Ein Mann, der „lacht“ & schläft.", "Mr. Smith isn't here!"], "en") == [
        'ein mann , der &quot; lacht &quot; &amp; schläft .', "mr. smith isn &apos;t here !"]
    # German nonbreaking prefixes keep "z.B." whole and ordinal numbers with their dot
    assert moses_lc(["Z.B. am 3. Mai."], "de") == ["z.b. am 3. mai ."]


def test_tok_lc_bleu_scores_the_tokenized_text():
    """bleu_tok_lc = sacreBLEU without its own tokenizer on moses_lc text (multi-bleu.perl's figure)."""
    from sacrebleu.metrics import BLEU

    hyps, refs = ["Two men aren't talking."], ["Two men aren't talking loudly."]
    scores = corpus_scores(hyps, refs, lang="en")
    by_hand = BLEU(tokenize="none").corpus_score(["two men aren &apos;t talking ."],
                                                 [["two men aren &apos;t talking loudly ."]])
    assert scores["bleu_tok_lc"] == pytest.approx(by_hand.score)
    assert scores["bleu_tok_lc"] != pytest.approx(scores["bleu_lc"])  # 13a keeps "aren't" whole
    assert scores["bleu_tok_lc_signature"].startswith("moses:lc+norm+tok.en|") and "tok:none" in scores[
        "bleu_tok_lc_signature"]
    assert "bleu_tok_lc" not in corpus_scores(hyps, refs)  # only with a language
    assert "Moses-tokenized" in format_table(scores)


def test_tok_lc_reference_length_matches_the_published_en_de_anchor(multi30k):
    """Wu et al. 2021's transformer_tiny log for en-de test_2016_flickr says reflen=12103 (fairseq-generate
    on Multi30k's lc.norm.tok files); moses_lc of the raw German references gives the same count."""
    from transformer_cli.metrics import read_lines, tok_lc_bleu

    refs = read_lines(multi30k / "test_2016_flickr.de.gz")
    score, _ = tok_lc_bleu(refs, refs, "de")
    assert score.ref_len == 12103 and score.score == pytest.approx(100.0)
