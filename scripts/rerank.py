r"""Rerank a run's n-best translations with a reverse-direction ("channel") model.

    python scripts/rerank.py --run-dir runs/multi30k_de_en --channel runs/multi30k_en_de \
        --split valid --nbest 5 --weights 0,0.25,0.5,0.75,1          # pick a weight on validation
    python scripts/rerank.py --run-dir runs/multi30k_de_en --channel runs/multi30k_en_de \
        --split test --nbest 5 --weights 0.5 --out test.reranked.en   # then use it once on test
    (--channel twice or more: the channel models score as an ensemble, the mean of their probabilities)

The run decodes the split's sources with beam search and keeps the n best (with their
length-normalised scores s(y|x), the beam's own ranking). The channel run, which translates the
other way, scores every candidate by how well it explains the source: c(x|y) = log P(x | y) / |x|,
|x| the source's subwords + EOS in the channel's tokenizer (tcli score). Each sentence keeps the
candidate with the highest s(y|x) + w * c(x|y); w = 0 is plain beam search. This is the
direct + channel part of noisy-channel reranking (Yee et al., 2019), without a language model.

For every weight the script prints one JSON line to stdout (weight, BLEU, lowercased BLEU, chrF,
how many sentences changed); --out writes the translations of the best weight (by cased BLEU).
The weight must be chosen on validation and then applied to test alone, never tuned on test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.errors import ConfigError, TcliError  # noqa: E402


def log(message: str) -> None:
    print(f"rerank: {message}", file=sys.stderr, flush=True)


def pick(direct: Sequence[Sequence[float]], channel: Sequence[Sequence[float]], weight: float) -> list[int]:
    """Per sentence the index of the candidate with the highest direct + weight * channel (first on ties)."""
    best = []
    for d, c in zip(direct, channel):
        totals = [a + weight * b for a, b in zip(d, c)]
        best.append(max(range(len(totals)), key=lambda i: (totals[i], -i)))
    return best


def channel_scores(channel, sources: Sequence[str], nbest: Sequence[Sequence[tuple[str, float]]],
                   quiet: bool) -> list[list[float]]:
    """Per sentence, per candidate: log P(source | candidate) / (source subwords + EOS) under `channel`."""
    flat_hyps = [hyp for cands in nbest for hyp, _ in cands]
    flat_srcs = [src for src, cands in zip(sources, nbest) for _ in cands]
    # the roles swap: the candidate is the channel model's source, the source its target
    scored = iter(channel.score(flat_hyps, flat_srcs, progress=not quiet))
    return [[lp / n for lp, n in (next(scored) for _ in cands)] for cands in nbest]


def parse_weights(text: str) -> list[float]:
    try:
        weights = [float(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ConfigError(f"--weights: give comma-separated numbers, got '{text}'") from None
    if not weights:
        raise ConfigError("--weights: give at least one number")
    return weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, type=Path, help="the SRC->TGT run whose n-best is reranked")
    ap.add_argument("--channel", required=True, type=Path, action="append",
                    help="a TGT->SRC run dir (or RUN/checkpoints/NAME); repeat it for an ensemble of channel models")
    ap.add_argument("--ensemble", type=Path, action="append", default=[],
                    help="another SRC->TGT run dir decoding with --run-dir, as `tcli translate --ensemble` (repeatable)")
    ap.add_argument("--split", default="valid", choices=["valid", "test"])
    ap.add_argument("--checkpoint", default="best", help="the run's checkpoint (default: best)")
    ap.add_argument("--channel-checkpoint", default="best", help="the channel run's checkpoint (default: best)")
    ap.add_argument("--nbest", type=int, default=5, help="candidates per sentence (default: 5)")
    ap.add_argument("--beam", type=int, default=None, help="beam size (default: --nbest)")
    ap.add_argument("--weights", default="0,0.25,0.5,0.75,1", help="comma-separated channel weights to try")
    ap.add_argument("--out", type=Path, default=None, help="write the best weight's translations here")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: decode.threads)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        run(args)
    except TcliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(args) -> None:
    from transformer_cli.checkpoint import checkpoint_in_run
    from transformer_cli.data import load_split
    from transformer_cli.io_utils import atomic_write_text
    from transformer_cli.metrics import corpus_scores
    from transformer_cli.translator import Translator, one_line

    weights = parse_weights(args.weights)
    beam = args.beam or args.nbest
    if args.nbest < 1 or beam < args.nbest:
        raise ConfigError(f"--nbest must be >= 1 and at most the beam size, got --nbest {args.nbest} --beam {beam}")
    decode = dict(beam=beam, nbest=args.nbest, threads=args.threads)
    direct = Translator.from_run_dir(args.run_dir, args.checkpoint, device=args.device, decode=decode,
                                     ensemble=args.ensemble)
    first, *others = args.channel
    inside = checkpoint_in_run(first)
    channel_dir, channel_ckpt = (inside[1], str(inside[0])) if inside else (first, args.channel_checkpoint)
    channel = Translator.from_run_dir(channel_dir, channel_ckpt, device=args.device, decode=dict(threads=args.threads),
                                      ensemble=others)
    pair = (direct.cfg.data.src_lang, direct.cfg.data.tgt_lang)
    if (channel.cfg.data.src_lang, channel.cfg.data.tgt_lang) != pair[::-1]:
        raise ConfigError(f"--channel {first} translates {channel.cfg.data.src_lang}-{channel.cfg.data.tgt_lang}; "
                          f"it must translate {pair[1]}-{pair[0]}, the reverse of {args.run_dir}")
    data = load_split(args.run_dir, args.split)
    start = time.perf_counter()
    nbest = direct.translate_nbest(data.src_text, progress=not args.quiet)
    log(f"decoded {len(nbest)} sentences, beam {beam}, {args.nbest}-best, in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    chan = channel_scores(channel, data.src_text, nbest, args.quiet)
    log(f"channel-scored {sum(map(len, nbest))} candidates in {time.perf_counter() - start:.1f} s")
    direct_scores = [[score for _, score in cands] for cands in nbest]
    best_weight, best_bleu, best_hyps = None, float("-inf"), []
    for w in weights:
        chosen = pick(direct_scores, chan, w)
        hyps = [one_line(cands[i][0]) for cands, i in zip(nbest, chosen)]
        scores = corpus_scores(hyps, data.tgt_text, direct.cfg.eval.tokenize)
        row = dict(split=args.split, weight=w, bleu=round(scores["bleu"], 2), bleu_lc=round(scores["bleu_lc"], 2),
                   chrf=round(scores["chrf"], 2), changed=sum(i != 0 for i in chosen), nbest=args.nbest, beam=beam)
        print(json.dumps(row), flush=True)
        if scores["bleu"] > best_bleu:
            best_weight, best_bleu, best_hyps = w, scores["bleu"], hyps
    if args.out is not None:
        atomic_write_text(args.out, "".join(h + "\n" for h in best_hyps))
        log(f"wrote {args.out} (weight {best_weight})")


if __name__ == "__main__":
    sys.exit(main())
