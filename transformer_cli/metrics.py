"""sacreBLEU wrappers: corpus BLEU (cased and lowercased) and chrF, each with its signature.

The numbers are the ones the `sacrebleu` command line prints for the same hypothesis and reference
files (detokenized text, 13a tokenizer by default, one reference). Given the target language,
`bleu_tok_lc` adds the figure published Multi30k results count: BLEU on lowercased,
punctuation-normalised, Moses-tokenized text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import DataError


def moses_lc(lines: Sequence[str], lang: str) -> list[str]:
    """Lowercase, normalise punctuation, Moses-tokenize: Multi30k's own preprocessing of its `tok` files.

    The steps and their order are those of the data set's scripts/task1-tokenize.sh (lowercase.perl,
    normalize-punctuation.perl -l LANG, tokenizer.perl -l LANG), through sacremoses, the Python port
    of those Moses scripts; the tokenizer escapes &, <, >, ', ", [ and ] as Moses does by default.
    """
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), escape=True, return_str=True) for line in lines]


def tok_lc_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str):
    """BLEU of `moses_lc` text, split on spaces only: multi-bleu.perl's and fairseq-generate's figure."""
    from sacrebleu.metrics import BLEU

    metric = BLEU(tokenize="none", force=True)  # force: the text is tokenized on purpose
    score = metric.corpus_score(moses_lc(hyps, lang), [moses_lc(refs, lang)])
    return score, f"moses:lc+norm+tok.{lang}|" + str(metric.get_signature())


def corpus_scores(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a", lang: str | None = None) -> dict:
    """Corpus BLEU, lowercased BLEU and chrF of detokenized `hyps` against one reference each.

    With the target language `lang` also `bleu_tok_lc`, BLEU on `moses_lc` text (see `tok_lc_bleu`).
    """
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
    if lang:
        score, signature = tok_lc_bleu(hyps, refs[0], lang)
        out.update(bleu_tok_lc=float(score.score), bleu_tok_lc_signature=signature,
                   bleu_tok_lc_detail=score.format(width=2))
    return out


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file (or .gz) with trailing whitespace stripped, as the sacrebleu CLI reads them.

    Only \n ends a line (sacrebleu opens with newline="\n"): a lone \r inside a sentence stays in it.
    Unreadable or non-UTF-8 files are a DataError naming the file (and the first bad line).
    """
    from .data import read_lines as read_text_lines  # numpy: only loaded when files are read

    return [line.rstrip() for line in read_text_lines(Path(path))]


def score_files(hyp_path: str | Path, ref_path: str | Path, tokenize: str = "13a", lang: str | None = None) -> dict:
    """`corpus_scores` of two files; different line counts are a DataError naming both files."""
    hyps, refs = read_lines(hyp_path), read_lines(ref_path)
    if len(hyps) != len(refs):
        raise DataError(
            f"{hyp_path} has {len(hyps)} lines but {ref_path} has {len(refs)}; "
            "the hypothesis file needs one line per reference line"
        )
    if not refs:
        raise DataError(f"{ref_path} is empty; there is nothing to score {hyp_path} against")
    return corpus_scores(hyps, refs, tokenize, lang)


def format_table(scores: dict) -> str:
    """A human-readable table: metric, score and sacreBLEU signature per line."""
    rows = [("BLEU", scores["bleu"], scores["bleu_signature"]),
            ("BLEU (lowercased)", scores["bleu_lc"], scores["bleu_lc_signature"]),
            ("chrF", scores["chrf"], scores["chrf_signature"])]
    if "bleu_tok_lc" in scores:
        rows.append(("BLEU (Moses-tokenized, lc)", scores["bleu_tok_lc"], scores["bleu_tok_lc_signature"]))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric':<{width}}  {'score':>6}  signature"]
    lines += [f"{name:<{width}}  {value:6.2f}  {sig}" for name, value, sig in rows]
    return "\n".join(lines)
