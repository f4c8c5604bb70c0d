r"""Build a training set from teacher translations (sequence-level distillation, data diversification).

    python scripts/distill.py --config configs/multi30k_de_en.yaml --out runs/kd/data_de_en \
        --teacher runs/multi30k_de_en [--ensemble runs/multi30k_de_en_seed2] \
        [--backward runs/multi30k_en_de] [--no-original] [--checkpoint best] [--beam 5]
    tcli train --config configs/multi30k_de_en.yaml --set data.path=runs/kd/data_de_en --set data.format=text

Reads the training split of the config's data and writes a text-format data folder (OUT/train.SRC,
OUT/train.TGT; the config's validation and test files linked, or written when not text) whose
training pairs are, in this order:
  - the original pairs (unless --no-original);
  - forward: each source with the teacher's translation as target (--teacher, a SRC->TGT run;
    --ensemble adds members whose probabilities are averaged): Kim & Rush's sequence-level
    knowledge distillation (2016) when alone, "forward translation" when mixed with the original;
  - backward: each target with a TGT->SRC model's translation as source (--backward; back-translation
    of the training targets, the third part of Nguyen et al.'s data diversification, 2020).
Validation and test stay the original data, so the student's model selection and scores are
comparable. Logs go to stderr; the command that trains a student on the folder goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.config import load_config  # noqa: E402
from transformer_cli.data import read_pairs, source_files  # noqa: E402
from transformer_cli.errors import ConfigError, TcliError  # noqa: E402
from transformer_cli.io_utils import atomic_write_text  # noqa: E402


def log(message: str) -> None:
    print(f"distill: {message}", file=sys.stderr, flush=True)


def load_teacher(role: str, run_dir: Path, ensemble: list[Path], src: str, tgt: str, args):
    """A Translator for src -> tgt from a run dir; another direction is a one-line error."""
    from transformer_cli.translator import Translator

    decode = dict(beam=args.beam, alpha=args.alpha, threads=args.threads)
    translator = Translator.from_run_dir(run_dir, args.checkpoint, device=args.device, decode=decode, ensemble=ensemble)
    got = (translator.cfg.data.src_lang, translator.cfg.data.tgt_lang)
    if got != (src, tgt):
        raise ConfigError(f"{role} {run_dir} translates {got[0]} -> {got[1]}; it must translate {src} -> {tgt}")
    return translator


def translate_all(translator, lines: list[str], what: str, quiet: bool, original: list[str]) -> list[str]:
    """Translations of `lines`, one line each (an empty line stays empty).

    Logs their length against `original` (the side they stand in for), in words: a teacher whose beam
    output is short passes that on to the student, and beam search shortens the student's again."""
    from transformer_cli.translator import one_line

    start = time.perf_counter()
    out = [one_line(t) for t in translator.translate(lines, progress=not quiet)]
    secs = time.perf_counter() - start
    ratio = sum(len(t.split()) for t in out) / max(1, sum(len(t.split()) for t in original))
    log(f"{what}: translated {len(lines)} lines in {secs:.0f} s ({len(lines) / max(secs, 1e-9):.1f} lines/s); "
        f"length {ratio:.3f}x the original's, in words")
    return out


def write_lines(path: Path, lines: list[str]) -> None:
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def link_or_write(d, split: str, out: Path) -> None:
    """Give OUT the config's validation/test split: links to text files, else text written from the pairs."""
    if d.format == "text":
        for lang, found in zip((d.src_lang, d.tgt_lang), source_files(d, split)):
            target = out / (f"{split}.{lang}" + (".gz" if found.suffix == ".gz" else ""))
            for stale in (out / f"{split}.{lang}", out / f"{split}.{lang}.gz"):
                if stale.is_symlink() or stale.exists():
                    stale.unlink()
            os.symlink(found.resolve(), target)
        return
    src, tgt = read_pairs(d, split)
    write_lines(out / f"{split}.{d.src_lang}", src)
    write_lines(out / f"{split}.{d.tgt_lang}", tgt)


def distill(args) -> str:
    """Write the folder; returns the student's training command."""
    cfg = load_config(args.config, args.set)
    d = cfg.data
    if not (args.teacher or args.backward):
        raise ConfigError("give --teacher (forward translations) and/or --backward (back-translations)")
    if args.no_original and not args.teacher:
        raise ConfigError("--no-original without --teacher leaves only back-translated sources; add --teacher")
    if args.ensemble and not args.teacher:
        raise ConfigError("--ensemble adds members to --teacher; give --teacher too")
    if d.extra_src_langs:
        raise ConfigError("data.extra_src_langs: distill.py reads the configured pair only; set it to [] "
                          "(--set 'data.extra_src_langs=[]')")
    if d.format != "hub" and args.out.resolve() == Path(d.path).resolve():
        raise ConfigError(f"--out {args.out} is the config's data.path: writing there would replace the original files")
    # load every model first: a wrong run dir fails before minutes of translating
    forward = load_teacher("--teacher", args.teacher, args.ensemble, d.src_lang, d.tgt_lang, args) if args.teacher else None
    backward = load_teacher("--backward", args.backward, [], d.tgt_lang, d.src_lang, args) if args.backward else None
    src, tgt = read_pairs(d, d.train_split, quiet=args.quiet)
    if d.max_train_pairs:
        src, tgt = src[: d.max_train_pairs], tgt[: d.max_train_pairs]
    log(f"read {len(src)} training pairs ({d.src_lang} -> {d.tgt_lang}) from {d.path}")
    out_src: list[str] = [] if args.no_original else list(src)
    out_tgt: list[str] = [] if args.no_original else list(tgt)
    if forward is not None:
        out_src += src
        out_tgt += translate_all(forward, src, "forward", args.quiet, tgt)
    if backward is not None:
        out_src += translate_all(backward, tgt, "backward", args.quiet, src)
        out_tgt += tgt
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_lines(out / f"{d.train_split}.{d.src_lang}", out_src)
    write_lines(out / f"{d.train_split}.{d.tgt_lang}", out_tgt)
    for split in (d.valid_split, d.test_split):
        if split and split != d.train_split:
            link_or_write(d, split, out)
    log(f"wrote {len(out_src)} training pairs to {out}")
    sets = [*(args.set or []), f"data.path={out}", "data.format=text", "data.max_train_pairs=0"]
    return shlex.join(["tcli", "train", "--config", str(args.config), *(w for s in sets for w in ("--set", s))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True, help="config whose data is distilled (the student's)")
    ap.add_argument("--set", action="append", help="override a config key, as with tcli (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="folder to write (text format)")
    ap.add_argument("--teacher", type=Path, help="SRC->TGT run dir: forward translations of the sources")
    ap.add_argument("--ensemble", type=Path, action="append", default=[], help="more teacher run dirs, or checkpoint folders inside run dirs (repeatable)")
    ap.add_argument("--backward", type=Path, help="TGT->SRC run dir: back-translations of the targets")
    ap.add_argument("--no-original", action="store_true", help="leave the original pairs out")
    ap.add_argument("--checkpoint", default="best", help="best | last | averaged | step_N (default: best)")
    ap.add_argument("--beam", type=int, help="beam size (default: each run's decode.beam)")
    ap.add_argument("--alpha", type=float, help="length penalty (default: each run's decode.alpha)")
    ap.add_argument("--device", help="auto | cpu | cuda (default: each run's decode.device)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: each run's decode.threads)")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    args = ap.parse_args()
    try:
        print(distill(args))
    except TcliError as e:
        print(f"distill: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
