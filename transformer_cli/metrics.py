"""sacreBLEU wrappers: corpus BLEU (cased and lowercased) and chrF, each with its signature.

The numbers are the ones the `sacrebleu` command line prints for the same hypothesis and reference
files (detokenized text, 13a tokenizer by default, one reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import DataError


def corpus_scores(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a") -> dict:
    """Corpus BLEU, lowercased BLEU and chrF of detokenized `hyps` against one reference each."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hyps) != len(refs):
        raise DataError(f"{len(hyps)} hypotheses but {len(refs)} references; give one hypothesis per reference line")
    if not refs:  # sacrebleu would fail with an IndexError
        raise DataError("no sentences to score (0 hypotheses and 0 references)")
    hyps, refs = list(hyps), [list(refs)]
    out: dict = {"num_sentences": len(hyps)}
    for key, metric in (
        ("bleu", BLEU(tokenize=tokenize)),
        ("bleu_lc", BLEU(tokenize=tokenize, lowercase=True)),
        ("chrf", CHRF()),
    ):
        score = metric.corpus_score(hyps, refs)
        out[key] = float(score.score)
        out[f"{key}_signature"] = str(metric.get_signature())
        out[f"{key}_detail"] = score.format(width=2)  # e.g. "BLEU = 34.12 65.1/40.2/... (BP = ...)"
    return out


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file (or .gz) with trailing whitespace stripped, as the sacrebleu CLI reads them.

    Only \n ends a line (sacrebleu opens with newline="\n"): a lone \r inside a sentence stays in it.
    Unreadable or non-UTF-8 files are a DataError naming the file (and the first bad line).
    """
    from .data import read_lines as read_text_lines  # numpy: only loaded when files are read

    return [line.rstrip() for line in read_text_lines(Path(path))]


def score_files(hyp_path: str | Path, ref_path: str | Path, tokenize: str = "13a") -> dict:
    """`corpus_scores` of two files; different line counts are a DataError naming both files."""
    hyps, refs = read_lines(hyp_path), read_lines(ref_path)
    if len(hyps) != len(refs):
        raise DataError(
            f"{hyp_path} has {len(hyps)} lines but {ref_path} has {len(refs)}; "
            "the hypothesis file needs one line per reference line"
        )
    if not refs:
        raise DataError(f"{ref_path} is empty; there is nothing to score {hyp_path} against")
    return corpus_scores(hyps, refs, tokenize)


def format_table(scores: dict) -> str:
    """A human-readable table: metric, score and sacreBLEU signature per line."""
    rows = [("BLEU", scores["bleu"], scores["bleu_signature"]),
            ("BLEU (lowercased)", scores["bleu_lc"], scores["bleu_lc_signature"]),
            ("chrF", scores["chrf"], scores["chrf_signature"])]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric':<{width}}  {'score':>6}  signature"]
    lines += [f"{name:<{width}}  {value:6.2f}  {sig}" for name, value, sig in rows]
    return "\n".join(lines)
