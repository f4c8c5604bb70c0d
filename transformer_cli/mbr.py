"""Minimum Bayes risk (MBR) selection: of a sentence's candidates, pick the one most like the others.

Each candidate is scored by its mean sentence-level utility (sacreBLEU BLEU or chrF) against every
other candidate, which stand in as samples of the unknown reference (Kumar & Byrne 2004; Eikema &
Aziz 2020). The weights are uniform: the candidates are the beam's n-best, not samples, and the
model's scores already chose them.
"""

from __future__ import annotations

from typing import Sequence

def _metric(name: str):
    """A sacreBLEU metric object for sentence scores (BLEU with effective order, as is usual per sentence)."""
    from sacrebleu.metrics import BLEU, CHRF

    return BLEU(effective_order=True) if name == "bleu" else CHRF()


def expected_utility(candidates: Sequence[str], metric: str = "bleu") -> list[float]:
    """Per candidate its mean utility against the other candidates (one candidate: [0.0])."""
    m = _metric(metric)
    n = len(candidates)
    if n < 2:
        return [0.0] * n
    # utility is not symmetric (BLEU's brevity penalty, chrF's recall weight): all n * (n - 1) pairs
    return [sum(m.sentence_score(h, [r]).score for j, r in enumerate(candidates) if j != i) / (n - 1)
            for i, h in enumerate(candidates)]


def mbr_order(candidates: Sequence[str], metric: str = "bleu") -> list[int]:
    """Candidate indices by expected utility, best first; ties keep the given (model score) order."""
    utility = expected_utility(candidates, metric)
    return sorted(range(len(candidates)), key=lambda i: -utility[i])
