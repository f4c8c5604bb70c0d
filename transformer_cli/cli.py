"""The `tcli` command line: one thin function per command (parse, call the library, exit code)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import __version__
from .errors import ConfigError, TcliError

app = typer.Typer(
    name="tcli",
    help="Train, run and evaluate encoder-decoder Transformers for machine translation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Options shared by the commands that read a config.
ConfigOpt = typer.Option(..., "--config", "-c", help="YAML config file.", show_default=False)
SetOpt = typer.Option(None, "--set", help="Override a config key: --set train.lr=3e-4 (repeatable).")
RunDirOpt = typer.Option(None, "--run-dir", help="Run directory (default: run_dir from the config).")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bars or logs on stderr.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for user errors (or set TCLI_DEBUG=1)."),
) -> None:
    """Train, run and evaluate encoder-decoder Transformers for machine translation."""
    if debug:
        os.environ["TCLI_DEBUG"] = "1"


def load_cli_config(config: Path, sets: Optional[List[str]], run_dir: Optional[Path]):
    """Load a config with --set overrides and an optional --run-dir override."""
    from .config import load_config

    cfg = load_config(config, sets)
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    return cfg


@app.command()
def info() -> None:
    """Print the versions of tcli and torch, the device that would be used and where the package lives."""
    import platform

    import torch

    from .device import resolve_device

    device = resolve_device("auto")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    typer.echo(f"tcli {__version__}")
    typer.echo(f"torch {torch.__version__}")
    typer.echo(f"python {platform.python_version()}")
    typer.echo(f"device {device.type} ({name}, {torch.get_num_threads()} CPU threads)")
    typer.echo(f"package {Path(__file__).resolve().parent}")  # which copy of the code runs


@app.command("config")
def config_cmd(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file (default: built-in defaults)."),
    sets: Optional[List[str]] = SetOpt,
    run_dir: Optional[Path] = RunDirOpt,
    doc: bool = typer.Option(False, "--doc", help="Print the reference of every config key (Markdown)."),
) -> None:
    """Print the resolved config (after --set overrides) as YAML, or the key reference with --doc."""
    import yaml

    from .config import config_doc, load_config
    from .data import adopt_init_tokenizer

    if doc:
        typer.echo(config_doc(), nl=False)
        return
    cfg = load_config(config, sets)
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    adopt_init_tokenizer(cfg, Path(cfg.run_dir))  # fine-tuning: the tokenizer the run will use
    typer.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False), nl=False)


@app.command()
def train(
    config: Path = ConfigOpt,
    sets: Optional[List[str]] = SetOpt,
    run_dir: Optional[Path] = RunDirOpt,
    resume: bool = typer.Option(False, "--resume", help="Continue from checkpoints/last at the exact batch."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete the run dir's checkpoints and metrics first."),
    init_from: Optional[str] = typer.Option(
        None, "--init-from", metavar="PATH",
        help="Fine-tune: start from this run dir's best weights (or a checkpoint folder) with its tokenizer; "
             "the same as --set train.init_from=PATH."),
    quiet: bool = QuietOpt,
) -> None:
    """Train a model (prepares the data first when needed); works under torchrun for several processes."""
    import json
    import shlex

    if init_from is not None:
        sets = [*(sets or []), f"train.init_from={init_from}"]
    cfg = load_cli_config(config, sets, run_dir)  # before importing torch: a bad config fails in a second
    from .train import train as run_training

    launcher = ["tcli"]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # resume the way it was started
        launcher = ["torchrun", "--nproc_per_node", os.environ.get("LOCAL_WORLD_SIZE", "N"), "-m", "transformer_cli"]
    words = [*launcher, "train", "--config", str(config), *[w for s in sets or [] for w in ("--set", s)]]
    words += ["--run-dir", cfg.run_dir, "--resume"]
    summary = run_training(cfg, resume=resume, overwrite=overwrite, quiet=quiet,
                           resume_command=" ".join(map(shlex.quote, words)))
    if int(os.environ.get("RANK", "0")) == 0:
        typer.echo(json.dumps(summary))
    if summary["exit_code"]:
        raise typer.Exit(summary["exit_code"])


@app.command()
def average(
    run_dir: Path = typer.Option(..., "--run-dir", help="Run directory holding checkpoints/step_*."),
    last: int = typer.Option(0, "--last", help="Average the N most recent periodic checkpoints."),
    best: int = typer.Option(0, "--best", help="Average the N best periodic checkpoints (by train.valid_metric)."),
    output: str = typer.Option("averaged", "-o", "--output", help="Name of the folder under checkpoints/."),
) -> None:
    """Average checkpoint weights into checkpoints/averaged (or -o NAME)."""
    from .checkpoint import average as average_checkpoints
    from .config import load_config

    cfg_path = run_dir / "config.yaml"
    metric = load_config(cfg_path).train.valid_metric if cfg_path.is_file() else "bleu"
    out, used = average_checkpoints(run_dir, last=last, best=best, metric=metric, name=output)
    typer.echo(f"averaged {len(used)} checkpoints ({', '.join(p.name for p in used)}) into {out}")


@app.command()
def plot(
    run_dir: Path = typer.Option(..., "--run-dir", help="Run directory holding metrics.jsonl."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="PNG file (default: RUN_DIR/training.png)."),
) -> None:
    """Draw training curves (loss, valid BLEU/chrF vs step) from metrics.jsonl to a PNG."""
    from .plots import plot_training

    typer.echo(str(plot_training(run_dir, output)))


@app.command()
def prepare(
    config: Path = ConfigOpt,
    sets: Optional[List[str]] = SetOpt,
    run_dir: Optional[Path] = RunDirOpt,
    quiet: bool = QuietOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Read, clean, tokenize and encode the config's data into the run directory (cached)."""
    import json

    from .data import format_summary, prepare as prepare_data

    cfg = load_cli_config(config, sets, run_dir)
    summary = prepare_data(cfg, Path(cfg.run_dir), quiet=quiet)
    typer.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))


@app.command()
def download(
    name: str = typer.Argument(..., help="Data set to fetch: multi30k."),
    dest: Optional[Path] = typer.Option(None, "--dest", help="Target folder (default: data/NAME)."),
    base_url: Optional[str] = typer.Option(None, "--base-url", help="Mirror URL holding the files (http(s):// or file://)."),
    quiet: bool = QuietOpt,
) -> None:
    """Fetch a public data set's files and check their sha256 sums (Multi30k task 1: de, en, fr)."""
    from .download import download_dataset

    for path in download_dataset(name, dest or Path("data") / name, base_url=base_url, quiet=quiet):
        typer.echo(str(path))


DecodeRunDirOpt = typer.Option(..., "--run-dir", help="Trained run directory (config.yaml, tokenizer/, checkpoints/).")
CheckpointOpt = typer.Option(None, "--checkpoint", help="best | last | averaged | step_N | another folder under checkpoints/ (tcli average -o NAME) | PATH (default: decode.checkpoint).")
BeamOpt = typer.Option(None, "--beam", help="Beam size; 1 = greedy (default: decode.beam).")
AlphaOpt = typer.Option(None, "--alpha", help="Length penalty exponent (default: decode.alpha).")
DeviceOpt = typer.Option(None, "--device", help="auto | cpu | cuda | cuda:N | mps (default: decode.device).")
PrecisionOpt = typer.Option(None, "--precision", help="fp32 | bf16 | fp16 (default: decode.precision).")
MaxTokensOpt = typer.Option(None, "--max-tokens", help="Padded source tokens per batch (default: decode.max_tokens).")
ThreadsOpt = typer.Option(None, "--threads", help="CPU threads for torch (default: decode.threads; 0 = torch's default).")
MbrOpt = typer.Option(None, "--mbr", metavar="N", help="Minimum Bayes risk: of the beam's N best, output the one with the highest mean sentence BLEU (or --mbr-metric chrf) against the others (default: decode.mbr; 0 = off).")
MbrMetricOpt = typer.Option(None, "--mbr-metric", help="Utility for --mbr: bleu | chrf (default: decode.mbr_metric).")
EnsembleOpt = typer.Option(None, "--ensemble", metavar="RUN_DIR", help="Another run dir (same tokenizer and direction) whose same checkpoint decodes together with --run-dir's, averaging probabilities, or one of its checkpoint folders (RUN/checkpoints/NAME) to decode that one (repeatable).")


@app.command()
def translate(
    run_dir: Path = DecodeRunDirOpt,
    input: Optional[Path] = typer.Option(None, "-i", "--input", help="Input text, one sentence a line (default: stdin)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output file, written atomically (default: stdout)."),
    checkpoint: Optional[str] = CheckpointOpt,
    beam: Optional[int] = BeamOpt,
    alpha: Optional[float] = AlphaOpt,
    max_tokens: Optional[int] = MaxTokensOpt,
    nbest: Optional[int] = typer.Option(None, "--nbest", help="Print the N best as 'hyp<TAB>score' pairs on each line."),
    sampling: Optional[bool] = typer.Option(None, "--sampling/--no-sampling", help="Sample (decode.temperature/top_k/top_p) instead of searching."),
    mbr: Optional[int] = MbrOpt,
    mbr_metric: Optional[str] = MbrMetricOpt,
    device: Optional[str] = DeviceOpt,
    precision: Optional[str] = PrecisionOpt,
    threads: Optional[int] = ThreadsOpt,
    buffer_size: Optional[int] = typer.Option(None, "--buffer-size", help="Lines read before translating them (default: 1 on a terminal, else 1000)."),
    sets: Optional[List[str]] = typer.Option(None, "--set", help="Override a decode key: --set decode.temperature=0.7 (repeatable)."),
    ensemble: Optional[List[Path]] = EnsembleOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Translate text line by line (stdin or -i) to stdout or -o, in input order; empty lines stay empty."""
    from .io_utils import atomic_path
    from .translator import Translator, decode_overrides, translate_stream_to

    if buffer_size is not None and buffer_size < 1:
        raise ConfigError(f"--buffer-size must be >= 1, got {buffer_size}")
    decode = {**decode_overrides(sets), **dict(beam=beam, alpha=alpha, max_tokens=max_tokens, nbest=nbest,
                                                 sampling=sampling, mbr=mbr, mbr_metric=mbr_metric,
                                                 precision=precision, threads=threads)}
    translator = Translator.from_run_dir(run_dir, checkpoint, device=device, decode=decode, ensemble=ensemble or ())
    nbest = translator.decode_cfg.nbest
    if nbest > translator.decode_cfg.beam:
        raise ConfigError(f"--nbest {nbest} exceeds the beam size {translator.decode_cfg.beam}; raise --beam")
    if buffer_size is None:
        buffer_size = 1 if input is None and sys.stdin.isatty() else 1000
    try:
        source = open(input, "rb") if input is not None else sys.stdin.buffer
    except OSError as e:
        raise ConfigError(f"{input}: cannot open the input file ({e.strerror or e})") from None
    name = str(input) if input is not None else "stdin"
    with source:
        if output is None:
            def write(line: str) -> None:
                sys.stdout.write(line)
                sys.stdout.flush()  # a pipe reader gets every line as soon as it is ready

            translate_stream_to(translator, source, name, write, buffer_size, nbest, quiet)
        else:
            with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
                translate_stream_to(translator, source, name, out.write, buffer_size, nbest, quiet)


@app.command("eval")
def eval_cmd(
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Trained run directory."),
    split: Optional[str] = typer.Option(None, "--split", help="test | valid (default: eval.split)."),
    hyp: Optional[Path] = typer.Option(None, "--hyp", help="Score this hypothesis file (with --ref) instead of decoding."),
    ref: Optional[Path] = typer.Option(None, "--ref", help="Reference file for --hyp."),
    lang: Optional[str] = typer.Option(None, "--lang", help="Target language of --hyp/--ref (e.g. de): also BLEU on Moses-tokenized lowercased text, how published Multi30k figures are counted (a run dir's split uses its data.tgt_lang)."),
    checkpoint: Optional[str] = CheckpointOpt,
    beam: Optional[int] = BeamOpt,
    alpha: Optional[float] = AlphaOpt,
    max_tokens: Optional[int] = MaxTokensOpt,
    mbr: Optional[int] = MbrOpt,
    mbr_metric: Optional[str] = MbrMetricOpt,
    device: Optional[str] = DeviceOpt,
    precision: Optional[str] = PrecisionOpt,
    threads: Optional[int] = ThreadsOpt,
    ensemble: Optional[List[Path]] = EnsembleOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the scores as JSON."),
    quiet: bool = QuietOpt,
) -> None:
    """sacreBLEU BLEU (cased, 13a), lowercased BLEU, chrF and Moses-tokenized lc BLEU of a decoded split (or of --hyp vs --ref).

    Hypotheses go to RUN/hyps/<split>.<ckpt>.txt and scores to RUN/scores.json.
    A --beam, --alpha or --precision other than the config's goes into the name: test.best.alpha1.5.txt.
    """
    import json

    from .metrics import format_table, score_files

    if (hyp is None) != (ref is None):
        raise ConfigError("--hyp and --ref go together; give both files, or neither to decode a split")
    if lang is not None and hyp is None:
        raise ConfigError("--lang goes with --hyp/--ref; a run dir's split is scored in its data.tgt_lang")
    if hyp is not None and ensemble:
        raise ConfigError("--ensemble decodes a split with --run-dir; it does not apply to --hyp/--ref")
    if hyp is not None:
        scores = score_files(hyp, ref, lang=lang)
    elif run_dir is None:
        raise ConfigError("give --run-dir to decode a split, or --hyp FILE --ref FILE to score files")
    else:
        if split is not None and split not in ("test", "valid"):
            raise ConfigError(f"--split must be test or valid, got '{split}'")
        from .translator import evaluate_run  # imports torch: not needed to score two files

        decode = dict(beam=beam, alpha=alpha, max_tokens=max_tokens, mbr=mbr, mbr_metric=mbr_metric,
                      precision=precision, threads=threads)
        scores = evaluate_run(run_dir, split or _eval_split(run_dir), checkpoint, device, decode, quiet, ensemble or ())
    typer.echo(json.dumps(scores, indent=2) if as_json else format_table(scores))


@app.command()
def score(
    run_dir: Path = DecodeRunDirOpt,
    src: Path = typer.Option(..., "-s", "--src", help="Source sentences, one a line."),
    tgt: Path = typer.Option(..., "-t", "--tgt", help="Target sentences, aligned with --src line by line."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output file, written atomically (default: stdout)."),
    checkpoint: Optional[str] = CheckpointOpt,
    per_token: bool = typer.Option(False, "--per-token", help="Print the mean log-probability per target subword (EOS included) instead of the sum."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Padded tokens per batch on the longer side (default: decode.max_tokens)."),
    device: Optional[str] = DeviceOpt,
    precision: Optional[str] = PrecisionOpt,
    threads: Optional[int] = ThreadsOpt,
    ensemble: Optional[List[Path]] = typer.Option(None, "--ensemble", metavar="RUN_DIR", help="Another run dir (same tokenizer and direction), or one of its checkpoint folders, scoring by the mean of the models' probabilities (repeatable)."),
    quiet: bool = QuietOpt,
) -> None:
    """Print log P(target | source) of each line pair (natural log, summed over the target's subwords and EOS)."""
    from .io_utils import atomic_write_text
    from .metrics import read_lines
    from .translator import Translator, score_summary

    sources, targets = read_lines(src), read_lines(tgt)
    if len(sources) != len(targets):
        raise ConfigError(f"--src {src} has {len(sources)} lines but --tgt {tgt} has {len(targets)}; give aligned files")
    decode = dict(max_tokens=max_tokens, precision=precision, threads=threads)
    translator = Translator.from_run_dir(run_dir, checkpoint, device=device, decode=decode, ensemble=ensemble or ())
    scored = translator.score(sources, targets, progress=not quiet)
    text = "".join(f"{lp / n if per_token else lp:.4f}\n" for lp, n in scored)
    if output is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(output, text)
    if not quiet:
        print(score_summary(scored), file=sys.stderr)


def _eval_split(run_dir: Path) -> str:
    """eval.split of the run's config (test when there is no config: from_run_dir reports that)."""
    from .config import load_config

    path = run_dir / "config.yaml"
    return load_config(path).eval.split if path.is_file() else "test"


@app.command()
def attention(
    run_dir: Path = DecodeRunDirOpt,
    text: str = typer.Option(..., "--text", help="Source sentence to translate and draw."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="PNG file (default: RUN_DIR/attention.png)."),
    layer: str = typer.Option("all", "--layer", help="Layer to draw, 1 = first, or 'all'."),
    heads: bool = typer.Option(False, "--heads/--average", help="One panel per head, or the heads' average."),
    encoder: bool = typer.Option(False, "--encoder", help="Draw the encoder self-attention instead of the cross-attention."),
    checkpoint: Optional[str] = CheckpointOpt,
    beam: Optional[int] = BeamOpt,
    device: Optional[str] = DeviceOpt,
) -> None:
    """Draw attention weights (target x source subwords) of one translation to a PNG heatmap."""
    from .translator import Translator, draw_attention

    translator = Translator.from_run_dir(run_dir, checkpoint, device=device, decode=dict(beam=beam))
    path, translation = draw_attention(translator, text, output or run_dir / "attention.png", layer, heads, encoder)
    typer.echo(translation)
    typer.echo(str(path))


class Terminated(BaseException):
    """SIGTERM as an exception (not an Exception: nothing may swallow it), so `finally` blocks remove temp files."""


def _terminate(signum, frame) -> None:
    raise Terminated()


INTERRUPTED = "error: interrupted (Ctrl-C); files being written were discarded"


def _caused_by_interrupt(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is in the exception's cause/context chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: run the app, turning user errors into `error: ...` and an exit code."""
    import signal

    signal.signal(signal.SIGTERM, _terminate)  # training installs its own handler (checkpoint, then 143)
    try:
        app(args=argv, prog_name="tcli", standalone_mode=True)
    except TcliError as e:
        if os.environ.get("TCLI_DEBUG") == "1":
            import traceback

            traceback.print_exc()  # and still the one-line message and the documented exit code
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # one raised outside Typer's own handling
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
    except SystemExit as e:  # Typer turns a KeyboardInterrupt into a silent exit 130: say what happened
        if e.code == 130 and _caused_by_interrupt(e):
            print(INTERRUPTED, file=sys.stderr)
        raise
    except Terminated:
        print("error: terminated by SIGTERM; files being written were discarded", file=sys.stderr)
        sys.exit(143)


__all__ = ["app", "main", "load_cli_config", "ConfigError"]
