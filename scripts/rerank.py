r"""Rerank a run's n-best translations with more models: a reverse-direction "channel" model, and
models of the same direction that need not share the run's tokenizer.

    python scripts/rerank.py --run-dir runs/multi30k_de_en --channel runs/multi30k_en_de \
        --split valid --nbest 5 --weights 0,0.25,0.5,0.75,1          # pick a weight on validation
    python scripts/rerank.py --run-dir runs/multi30k_de_en --channel runs/multi30k_en_de \
        --split test --nbest 5 --weights 0.5 --out test.reranked.en   # then use it once on test
    (--channel twice or more: the channel models score as an ensemble, the mean of their probabilities;
     --rescorer RUN (repeatable) with --rescorer-weights adds same-direction models, e.g. runs with
     another vocabulary, which `--ensemble` cannot combine; --r2l RUN (repeatable) with --r2l-weights
     adds right-to-left runs (data.target_order: r2l) as a feature of their own; --alpha sets the beam
     search's length penalty, to be chosen on validation like the weights)

The run decodes the split's sources with beam search and keeps the n best (with their
length-normalised scores s(y|x), the beam's own ranking). The channel run, which translates the
other way, scores every candidate by how well it explains the source: c(x|y) = log P(x | y) / |x|,
|x| the source's subwords + EOS in the channel's tokenizer (tcli score). A rescorer gives
r(y|x) = log P(y | x) / |y| in its own tokenizer (the mean over several rescorers), a right-to-left
run l(y|x) the same, read from the last subword to the first (the mean over several). Each sentence
keeps the candidate with the highest s(y|x) + w * c(x|y) + v * r(y|x) + u * l(y|x); w = v = u = 0 is
plain beam search. The channel term is the direct + channel part of noisy-channel reranking (Yee et al.,
2019), without a language model.

--cache DIR keeps the n-best lists and every model's scores (keyed by the weights files, their size
and mtime, and the sentences), so trying other weights or adding a model later decodes nothing again.
For every combination of weights the script prints one JSON line to stdout (weights, BLEU, lowercased
BLEU, chrF, how many sentences changed); --out writes the translations of the best one (by cased BLEU).
Weights must be chosen on validation and then applied to test alone, never tuned on test.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
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


def pick(scores: Sequence[Sequence[Sequence[float]]], weights: Sequence[float]) -> list[int]:
    """Per sentence the index of the candidate with the highest s + sum(w * f) (first on ties).

    scores[sentence][candidate] = (s, f1, f2, ...): the beam's score, then one value per feature."""
    best = []
    for cands in scores:
        totals = [c[0] + sum(w * f for w, f in zip(weights, c[1:])) for c in cands]
        best.append(max(range(len(totals)), key=lambda i: (totals[i], -i)))
    return best


def per_token_scores(model, sources: Sequence[str], targets: Sequence[str], quiet: bool) -> list[float]:
    """log P(target | source) / (target subwords + EOS) of each pair under `model` (a Translator)."""
    return [lp / n for lp, n in model.score(sources, targets, progress=not quiet)]


def regroup(flat: Sequence[float], nbest: Sequence[Sequence]) -> list[list[float]]:
    """A flat list of per-candidate values back into per-sentence lists shaped like `nbest`."""
    values = iter(flat)
    return [[next(values) for _ in cands] for cands in nbest]


def cached(folder: Path | None, key: dict, compute):
    """compute() once per key: with --cache its JSON result is kept in `folder` for later runs."""
    from transformer_cli.io_utils import atomic_write_text

    if folder is None:
        return compute()
    text = json.dumps(key, sort_keys=True)
    path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))["value"]
    value = compute()
    atomic_write_text(path, json.dumps({"key": key, "value": value}) + "\n")
    return value


def model_key(translator) -> list:
    """The weights files a Translator decodes with, with size and mtime (a retrained run is a new key),
    and "r2l" for a right-to-left run (the same weights score other id sequences)."""
    files = [Path(p) for p in (translator.members or [translator.checkpoint])]
    key = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    return key + ["r2l"] if translator.tokenizer.right_to_left else key


def digest(lines: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def parse_weights(text: str, option: str) -> list[float]:
    try:
        weights = [float(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ConfigError(f"{option}: give comma-separated numbers, got '{text}'") from None
    if not weights:
        raise ConfigError(f"{option}: give at least one number")
    return weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, type=Path, help="the SRC->TGT run whose n-best is reranked")
    ap.add_argument("--channel", type=Path, action="append", default=[],
                    help="a TGT->SRC run dir (or RUN/checkpoints/NAME); repeat it for an ensemble of channel models")
    ap.add_argument("--rescorer", type=Path, action="append", default=[],
                    help="a SRC->TGT run dir (or RUN/checkpoints/NAME), any tokenizer (repeatable; their mean counts)")
    ap.add_argument("--r2l", type=Path, action="append", default=[],
                    help="a right-to-left SRC->TGT run dir (data.target_order: r2l) or RUN/checkpoints/NAME "
                         "(repeatable; their mean counts, with its own weight)")
    ap.add_argument("--ensemble", type=Path, action="append", default=[],
                    help="another SRC->TGT run dir decoding with --run-dir, as `tcli translate --ensemble` (repeatable)")
    ap.add_argument("--split", default="valid", choices=["valid", "test"])
    ap.add_argument("--checkpoint", default="best", help="the run's checkpoint (default: best)")
    ap.add_argument("--channel-checkpoint", default="best",
                    help="the channel and rescorer runs' checkpoint, unless named as RUN/checkpoints/NAME (default: best)")
    ap.add_argument("--nbest", type=int, default=5, help="candidates per sentence (default: 5)")
    ap.add_argument("--beam", type=int, default=None, help="beam size (default: --nbest)")
    ap.add_argument("--alpha", type=float, default=None,
                    help="length penalty of the beam search and of its scores s(y|x) (default: decode.alpha)")
    ap.add_argument("--weights", default="0,0.25,0.5,0.75,1", help="comma-separated channel weights to try")
    ap.add_argument("--rescorer-weights", default="0,0.25,0.5,0.75,1", help="comma-separated rescorer weights to try")
    ap.add_argument("--r2l-weights", default="0,0.25,0.5,0.75,1", help="comma-separated right-to-left weights to try")
    ap.add_argument("--out", type=Path, default=None, help="write the best weight's translations here")
    ap.add_argument("--cache", type=Path, default=None,
                    help="keep the n-best lists and model scores in this folder and reuse them in later runs")
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


def load_scorer(role: str, path: Path, checkpoint: str, pair: tuple[str, str], args, ensemble=()):
    """A Translator that must translate pair[0] -> pair[1]; path may be RUN/checkpoints/NAME."""
    from transformer_cli.checkpoint import checkpoint_in_run
    from transformer_cli.translator import Translator

    inside = checkpoint_in_run(path)
    run_dir, ckpt = (inside[1], str(inside[0])) if inside else (path, checkpoint)
    model = Translator.from_run_dir(run_dir, ckpt, device=args.device, decode=dict(threads=args.threads),
                                    ensemble=ensemble)
    got = (model.cfg.data.src_lang, model.cfg.data.tgt_lang)
    if got != pair:
        raise ConfigError(f"{role} {path} translates {got[0]}-{got[1]}; it must translate {pair[0]}-{pair[1]}"
                          f"{', the reverse of ' + str(args.run_dir) if role == '--channel' else ''}")
    return model


def run(args) -> None:
    from transformer_cli.data import load_split
    from transformer_cli.io_utils import atomic_write_text
    from transformer_cli.metrics import corpus_scores
    from transformer_cli.translator import Translator, one_line

    if not args.channel and not args.rescorer and not args.r2l:
        raise ConfigError("give --channel RUN (a reverse-direction run) and/or --rescorer RUN (or --r2l RUN) to rerank with")
    channel_weights = parse_weights(args.weights, "--weights") if args.channel else [0.0]
    rescorer_weights = parse_weights(args.rescorer_weights, "--rescorer-weights") if args.rescorer else [0.0]
    r2l_weights = parse_weights(args.r2l_weights, "--r2l-weights") if args.r2l else [0.0]
    beam = args.beam or args.nbest
    if args.nbest < 1 or beam < args.nbest:
        raise ConfigError(f"--nbest must be >= 1 and at most the beam size, got --nbest {args.nbest} --beam {beam}")
    decode = dict(beam=beam, nbest=args.nbest, threads=args.threads, alpha=args.alpha)
    direct = Translator.from_run_dir(args.run_dir, args.checkpoint, device=args.device, decode=decode,
                                     ensemble=args.ensemble)
    pair = (direct.cfg.data.src_lang, direct.cfg.data.tgt_lang)
    channel = (load_scorer("--channel", args.channel[0], args.channel_checkpoint, pair[::-1], args, args.channel[1:])
               if args.channel else None)
    rescorers = [load_scorer("--rescorer", r, args.channel_checkpoint, pair, args) for r in args.rescorer]
    r2ls = [load_scorer("--r2l", r, args.channel_checkpoint, pair, args) for r in args.r2l]
    for path, model in zip(args.r2l, r2ls):
        if not model.cfg.data.right_to_left:
            raise ConfigError(f"--r2l {path} writes left to right (data.target_order: l2r); pass it as --rescorer")
    data = load_split(args.run_dir, args.split)
    start = time.perf_counter()
    nbest_key = dict(what="nbest", model=model_key(direct), beam=beam, nbest=args.nbest,
                     alpha=direct.decode_cfg.alpha, sources=digest(data.src_text))
    nbest = cached(args.cache, nbest_key, lambda: direct.translate_nbest(data.src_text, progress=not args.quiet))
    log(f"{len(nbest)} sentences, beam {beam}, {args.nbest}-best, in {time.perf_counter() - start:.1f} s")
    hyps = [hyp for cands in nbest for hyp, _ in cands]
    srcs = [src for src, cands in zip(data.src_text, nbest) for _ in cands]
    pairs = digest(srcs + hyps)

    def scores_of(role: str, model, sources, targets) -> list[float]:
        key = dict(what=role, model=model_key(model), pairs=pairs)
        return cached(args.cache, key, lambda: per_token_scores(model, sources, targets, args.quiet))

    def mean_scores(models) -> list[float]:
        """Each candidate's per-token log-prob averaged over `models` (all zeros when there are none)."""
        rows = [scores_of("rescorer", m, srcs, hyps) for m in models]
        return [sum(col) / len(col) for col in zip(*rows)] if rows else [0.0] * len(hyps)

    start = time.perf_counter()
    # the channel swaps the roles: the candidate is its source, the sentence to translate its target
    chan = scores_of("channel", channel, hyps, srcs) if channel else [0.0] * len(hyps)
    resc = mean_scores(rescorers)
    r2l = mean_scores(r2ls)  # each r2l run's cache key says r2l, so sharing the "rescorer" role is safe
    log(f"scored {len(hyps)} candidates with {len(args.channel or [])} channel and {len(rescorers)} "
        f"rescorer model(s){f', {len(r2ls)} right-to-left' if r2ls else ''} in {time.perf_counter() - start:.1f} s")
    features = regroup(list(zip([s for cands in nbest for _, s in cands], chan, resc, r2l)), nbest)
    best_bleu, best_weights, best_hyps = float("-inf"), None, []
    for w, v, u in itertools.product(channel_weights, rescorer_weights, r2l_weights):
        chosen = pick(features, (w, v, u))
        out = [one_line(cands[i][0]) for cands, i in zip(nbest, chosen)]
        scores = corpus_scores(out, data.tgt_text, direct.cfg.eval.tokenize)
        row = dict(split=args.split, weight=w, rescorer_weight=v, r2l_weight=u, bleu=round(scores["bleu"], 2),
                   bleu_lc=round(scores["bleu_lc"], 2), chrf=round(scores["chrf"], 2),
                   changed=sum(i != 0 for i in chosen), nbest=args.nbest, beam=beam)
        print(json.dumps(row), flush=True)
        if scores["bleu"] > best_bleu:
            best_bleu, best_weights, best_hyps = scores["bleu"], (w, v, u), out
    if args.out is not None:
        atomic_write_text(args.out, "".join(h + "\n" for h in best_hyps))
        log(f"wrote {args.out} (weight {best_weights[0]}, rescorer weight {best_weights[1]}, "
            f"r2l weight {best_weights[2]})")


if __name__ == "__main__":
    sys.exit(main())
