"""Hardening table (issue 6): every command against bad input, faults and untrusted files.

Each row of CASES runs the real CLI in a subprocess and checks (a) the one-line `error: ...` on
stderr (a substring naming the file/line/key), (b) the exit code, (c) that no traceback is shown,
and (d) that every file on disk before the command is byte-identical after it (except the paths
the row says the command may write) and that no temporary file is left behind. A few rows
interrupt training with a signal. docs/robustness.md lists the rows and what each gets.

One small trained run (configs/smoke.yaml on 600 Multi30k pairs, 30 updates) is shared; rows that
change a run work on a copy. The rows run three at a time (they mostly wait for imports), each
test collects its own row's outcome.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from .conftest import ROOT

SMOKE = "configs/smoke.yaml"
TEST_LINES = 12
BLANK_SRC_LINES = (3, 8)  # 1-based test lines whose source is empty (line 8: the target too)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # tiny ops: more threads only wait
BASE_SETS = {
    "data.path": "{tiny}", "data.download": "false", "tokenizer.vocab_size": 400,
    "train.max_tokens": 1024, "train.max_steps": 30, "train.valid_every": 15, "train.log_every": 5,
    "train.warmup_steps": 10, "train.threads": 1, "train.keep_last": 2, "decode.max_len_b": 3,
}


def sets(**extra) -> tuple[str, ...]:
    """`--set k=v` words for BASE_SETS updated with `extra` (keys with '__' for '.')."""
    merged = {**BASE_SETS, **{k.replace("__", "."): v for k, v in extra.items()}}
    return tuple(w for k, v in merged.items() for w in ("--set", f"{k}={v}"))


def train(*more: str, **extra) -> tuple[str, ...]:
    """`tcli train` on the shared tiny data into {run}."""
    return ("train", "-c", SMOKE, "--run-dir", "{run}", *sets(**extra), *more)


# ----------------------------------------------------------------------------- shared run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, multi30k) -> Path:
    """600 training, 20 validation and 12 test pairs of Multi30k de-en; some test sources are empty."""
    folder = tmp_path_factory.mktemp("robust_data")
    for split, count in (("train", 600), ("val", 20), ("test_2016_flickr", TEST_LINES)):
        for lang in ("de", "en"):
            with gzip.open(multi30k / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [next(f).rstrip("\n") for _ in range(count)]
            if split.startswith("test"):
                for n in BLANK_SRC_LINES:
                    if lang == "de" or n == BLANK_SRC_LINES[1]:
                        lines[n - 1] = ""
            (folder / f"{split}.{lang}").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny) -> Path:
    """The shared run dir: checkpoints best, last, step_00000015, step_00000030."""
    run = tmp_path_factory.mktemp("robust_run") / "run"
    args = [a.format(run=run, tiny=tiny) for a in train()]
    result = subprocess.run([sys.executable, "-m", "transformer_cli", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"best", "last", "step_00000015", "step_00000030"}
    return run


# ----------------------------------------------------------------------------- the rows


@dataclass
class Ctx:
    """Where a row works: `tmp` its own folder, `run` its run dir, `tiny` the shared data."""

    tmp: Path
    run: Path
    tiny: Path

    def fmt(self, text: str) -> str:
        vocab = self.vocab if "{vocab}" in text else None
        return text.format(tmp=self.tmp, run=self.run, tiny=self.tiny, vocab=vocab)

    @property
    def vocab(self) -> int:
        """The run's (joint) vocabulary size."""
        return json.loads((self.run / "tokenizer/tokenizer.json").read_text())["src_vocab_size"]


@dataclass
class Case:
    """One row: tcli arguments ({tmp}, {run}, {tiny} filled in), expected exit code and stderr text."""

    id: str
    args: tuple[str, ...]
    code: int
    message: str  # substring of the `error:` line (or of stderr for exit 0 / signals)
    setup: Callable[[Ctx], None] | None = None
    run: str = "shared"  # shared (read-only) | copy (of the trained run) | prepared (data + tokenizer only)
    writes: tuple[str, ...] = ()  # paths under the row's folders the command may change
    check: Callable[[Ctx, "Outcome"], None] | None = None
    limit_file_size: int = 0  # RLIMIT_FSIZE in bytes: writes beyond it fail (disk-full stand-in)
    interrupt: tuple[Callable[[Ctx], bool], int] | None = None  # (when, signal) sent while running
    stdin: bytes | None = None
    traceback: bool = False  # only --debug shows one


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)


def write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def copy_data(ctx: Ctx) -> Path:
    shutil.copytree(ctx.tiny, ctx.tmp / "data")
    return ctx.tmp / "data"


class Payload:
    """Unpickling this runs `touch MARKER`: a loader that runs code leaves the marker behind."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def marker_absent(ctx: Ctx, out: Outcome) -> None:
    assert not (ctx.tmp / "MARKER").exists(), "the crafted file ran code"


def lines(text: str) -> list[str]:
    return text.split("\n")[:-1] if text else []


# -- setups


def malformed_yaml(ctx):
    write(ctx.tmp / "bad.yaml", "model: {d_model: 64\n  num_heads: [\n")


def python_tag_yaml(ctx):
    write(ctx.tmp / "evil.yaml", f'model: !!python/object/apply:os.system ["touch {ctx.tmp}/MARKER"]\n')


def unknown_key_yaml(ctx):
    write(ctx.tmp / "typo.yaml", "model:\n  d_model: 64\n  d_modle: 32\n")


def latin1_yaml(ctx):
    write(ctx.tmp / "latin1.yaml", "run_dir: runs/m\xfcller\n".encode("latin-1"))


def drop_val_en(ctx):
    (copy_data(ctx) / "val.en").unlink()


def short_train_en(ctx):
    path = copy_data(ctx) / "train.en"
    path.write_text("".join(path.read_text(encoding="utf-8").splitlines(True)[:-1]), encoding="utf-8")


def latin1_train_line(ctx):
    data = copy_data(ctx)
    with open(data / "train.de", "ab") as f:
        f.write("Stra\xdfe\n".encode("latin-1"))
    with open(data / "train.en", "a", encoding="utf-8") as f:
        f.write("street\n")


def empty_train(ctx):
    data = copy_data(ctx)
    write(data / "train.de", "")
    write(data / "train.en", "")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def pickle_state(ctx):
    import torch

    torch.save({"format": 1, "progress": Payload(ctx.tmp / "MARKER")}, ctx.run / "checkpoints/last/trainer_state.pt")


def pickle_split(ctx):
    write(ctx.run / "data/test.npz", pickle.dumps(Payload(ctx.tmp / "MARKER")))


def pickle_safetensors(ctx):
    write(ctx.tmp / "evil.safetensors", pickle.dumps(Payload(ctx.tmp / "MARKER")))


def smaller_model(ctx):
    """Weights of a d_model 32 model with the run's vocabulary, saved as other.safetensors."""
    from transformer_cli.checkpoint import save_weights
    from transformer_cli.config import load_config
    from transformer_cli.model import build_model

    cfg = load_config(ctx.run / "config.yaml", ["model.d_model=32", "model.ff_size=64"])
    vocab = json.loads((ctx.run / "tokenizer/tokenizer.json").read_text())["src_vocab_size"]
    save_weights(build_model(cfg, vocab, vocab), ctx.tmp / "other.safetensors")


def bigger_vocab(ctx):
    """Weights of the run's model shape with a vocabulary of 512 instead of the tokenizer's."""
    from transformer_cli.checkpoint import save_weights
    from transformer_cli.config import load_config
    from transformer_cli.model import build_model

    save_weights(build_model(load_config(ctx.run / "config.yaml"), 512, 512), ctx.tmp / "vocab512.safetensors")


def earlier_average(ctx):
    """An averaged checkpoint already on disk: a failed average must leave it as it is."""
    from transformer_cli.checkpoint import average

    average(ctx.run, last=1)


def source_lines(*texts: str | bytes):
    def setup(ctx):
        write(ctx.tmp / "in.txt", b"".join(t if isinstance(t, bytes) else t.encode() + b"\n" for t in texts))
    return setup


def line_break_model(ctx):
    """Rewrite best/ so that every output token is the byte piece <0x0A>, a newline."""
    from safetensors.torch import load_file, save_file

    from transformer_cli.tokenizer import Tokenizer

    path = ctx.run / "checkpoints/best/model.safetensors"
    weights = load_file(str(path))
    newline = Tokenizer.load(ctx.run / "tokenizer").tgt_sp.piece_to_id("<0x0A>")
    weights["decoder_norm.weight"].zero_()  # the decoder's output is the bias alone: the newline's row
    weights["decoder_norm.bias"].copy_(10 * weights["output.weight"][newline])
    save_file(weights, str(path))


def corrupt_mirror(ctx):
    write(ctx.tmp / "mirror/train.de.gz", gzip.compress(b"not the corpus\n"))


def translating_to_file(ctx) -> bool:
    """True once `translate -o out.txt` has opened its temporary output file."""
    return any(p.name.startswith(".out.txt.") for p in ctx.tmp.iterdir())


def hyp_ref(ctx):
    write(ctx.tmp / "hyp.txt", "a dog runs\na cat sits\nthree\n")
    write(ctx.tmp / "ref.txt", "a dog runs\na cat sits\n")


def score_bad_target(ctx):
    write(ctx.tmp / "in.txt", "Ein Hund.\nZwei Katzen.\n")
    write(ctx.tmp / "tgt.txt", b"A dog.\nTwo \xe9 cats.\n")
    write(ctx.tmp / "out.txt", "an earlier result\n")  # must survive the failed run


def empty_hyp_ref(ctx):
    write(ctx.tmp / "hyp.txt", "")
    write(ctx.tmp / "ref.txt", "")


def broken_metrics(ctx):
    with open(ctx.run / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 31, "train_loss": \n')


# -- checks


def no_run_dir(ctx, out):
    assert not (ctx.tmp / "run").exists(), "the command touched the run dir before failing"


def translated_in_order(ctx, out):
    warnings = [line for line in out.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: line 2: "), out.stderr
    inputs = (ctx.tmp / "in.txt").read_text(encoding="utf-8").split("\n")[:-1]
    got = lines(out.stdout)
    assert len(got) == len(inputs)
    assert all(g == "" for g, i in zip(got, inputs) if not i.strip())


def empty_output(ctx, out):
    assert (ctx.tmp / "out.txt").read_bytes() == b"" and out.stdout == ""
    umask = os.umask(0)
    os.umask(umask)
    assert (ctx.tmp / "out.txt").stat().st_mode & 0o777 == 0o666 & ~umask  # the usual mode, not a temp file's 0600


def split_aligned(ctx, out):
    scores = json.loads(out.stdout)
    hyps = (ctx.run / "hyps/test.best.txt").read_text(encoding="utf-8").split("\n")[:-1]
    refs = (ctx.run / "hyps/test.ref.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert scores["num_sentences"] == len(hyps) == len(refs) == TEST_LINES
    assert all(hyps[n - 1] == "" for n in BLANK_SRC_LINES)
    assert refs[7] == "" and refs[2] != ""


def file_translated_aligned(ctx, out):
    got = lines(out.stdout)
    assert len(got) == TEST_LINES and all(got[n - 1] == "" for n in BLANK_SRC_LINES)


def checkpoint_saved_on_sigterm(ctx, out):
    from transformer_cli import checkpoint as ck

    summary = json.loads(out.stdout)
    folder = ck.resumable(ctx.run)
    assert folder is not None and summary["stopped"] == "signal" and summary["exit_code"] == 143
    assert ck.load_state(folder)["progress"]["step"] == summary["step"] >= 1


def last_checkpoint_loads(ctx, out, during_write: bool = True):
    """After a kill in the middle of a checkpoint write, `last` is whole: weights, state and info of one step."""
    from safetensors import safe_open

    from transformer_cli import checkpoint as ck

    hidden = [p.name for p in (ctx.run / "checkpoints").iterdir() if p.name.startswith(".last.")]
    assert hidden or not during_write, "the kill did not land inside a checkpoint write"
    weights = ck.resolve_checkpoint(ctx.run, "last")
    folder = ck.resumable(ctx.run)
    assert folder == weights.parent
    step = ck.load_state(folder)["progress"]["step"]
    assert ck.read_info(folder)["step"] == step >= 1
    with safe_open(str(weights), "pt") as f:
        assert f.metadata()["step"] == str(step)  # the weights belong to the same update
    assert len(ck.load_tensors(weights)) > 0
    ck.recover(ctx.run)  # what the next `tcli train --resume` does first
    left = [p.name for p in (ctx.run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert left == [] and ck.load_state(ck.resumable(ctx.run))["progress"]["step"] == step


def killed_during_write(ctx) -> bool:
    """True while `last` exists and its replacement is being written (hidden temp folder present)."""
    root = ctx.run / "checkpoints"
    try:
        return (root / "last").is_dir() and any(p.name.startswith(".last.") for p in root.iterdir())
    except OSError:
        return False


def switching_folders(ctx) -> bool:
    """True while a complete new `last` is being swapped in: the old one is renamed to `.last.old`."""
    return (ctx.run / "checkpoints/.last.old").exists()


def metrics_written(ctx) -> bool:
    return (ctx.run / "metrics.jsonl").is_file()


def config_set(override: str) -> tuple[str, ...]:
    return ("config", "-c", SMOKE, "--set", override)


TRANSLATE = ("translate", "--run-dir", "{run}", "--quiet")
PREPARE = ("prepare", "-c", SMOKE, "--run-dir", "{tmp}/run", *sets(data__path="{tmp}/data"))  # on {tmp}/data
TRAIN_NEW = ("train", "-c", SMOKE, "--run-dir", "{tmp}/run")
EVERY_STEP = train(train__max_steps=100000, train__valid_every=1, train__keep_best=1, train__keep_last=1)  # saves a lot
CASES = [
    # -- config files and options (fail before any work: no run dir is created)
    Case("yaml-malformed", ("train", "-c", "{tmp}/bad.yaml", "--run-dir", "{tmp}/run"), 2,
         "bad.yaml: line 2: invalid YAML", malformed_yaml, check=no_run_dir),
    Case("yaml-python-tag", ("train", "-c", "{tmp}/evil.yaml", "--run-dir", "{tmp}/run"), 2,
         "evil.yaml: line 1: invalid YAML (could not determine a constructor for the tag "
         "'tag:yaml.org,2002:python/object/apply:os.system')", python_tag_yaml,
         check=lambda c, o: (marker_absent(c, o), no_run_dir(c, o))),
    Case("set-python-tag", ("config", "-c", SMOKE, "--set", 'model.d_model=!!python/object/apply:os.system ["touch {tmp}/MARKER"]'),
         2, "the value is not a valid YAML scalar", check=marker_absent),
    Case("yaml-unknown-key", ("config", "-c", "{tmp}/typo.yaml"), 2,
         "typo.yaml: unknown key 'model.d_modle'; did you mean model.d_model?", unknown_key_yaml),
    Case("yaml-not-utf8", ("config", "-c", "{tmp}/latin1.yaml"), 2,
         "latin1.yaml: cannot read config file (UnicodeDecodeError", latin1_yaml),
    Case("config-missing", ("train", "-c", "{tmp}/nope.yaml", "--run-dir", "{tmp}/run"), 2,
         "nope.yaml: config file not found", check=no_run_dir),
    Case("set-unknown-key", config_set("train.warmup_step=100"), 2,
         "unknown key 'train.warmup_step'; did you mean train.warmup_steps?"),
    Case("set-no-equals", config_set("train.lr"), 2,
         "--set 'train.lr': expected KEY=VALUE"),
    Case("wrong-type", config_set("model.d_model=abc"), 2,
         "key 'model.d_model' must be int, got str 'abc'"),
    Case("negative-size", config_set("model.ff_size=-8"), 2,
         "key 'model.ff_size' must be > 0, got -8"),
    Case("zero-size", (*TRAIN_NEW, "--set", "train.max_tokens=0"), 2,
         "key 'train.max_tokens' must be > 0, got 0", check=no_run_dir),
    Case("not-finite", config_set("train.lr=.nan"), 2,
         "key 'train.lr' must be a finite number, got nan"),
    Case("heads-not-dividing", config_set("model.num_heads=5"), 2,
         "key 'model.num_heads' (5) must divide model.d_model (64)"),
    Case("no-stop-condition", (*TRAIN_NEW, "--set", "train.max_steps=0"), 2,
         "set at least one of train.max_steps", check=no_run_dir),
    Case("no-valid-split", (*TRAIN_NEW, "--set", "data.valid_split="), 2,
         "data.valid_split is empty, but training validates", check=no_run_dir),
    # -- input data (tcli prepare)
    Case("data-file-missing", PREPARE, 2,
         "data/val.en: file not found (also tried .gz); check data.path and data.valid_split", drop_val_en),
    Case("parallel-length", PREPARE, 2,
         "data/train.de has 600 lines but {tmp}/data/train.en has 599 lines", short_train_en),
    Case("train-not-utf8", PREPARE, 2,
         "data/train.de: line 601 is not valid UTF-8", latin1_train_line),
    Case("train-empty", PREPARE, 2,
         "the train split ('train') is empty", empty_train),
    # -- training runs
    Case("run-dir-holds-other-run", train(model__d_model=32), 2,
         "already holds a run with a different config (model.d_model: 64 -> 32)", run="copy"),
    Case("resume-without-checkpoint", train("--resume"), 2,
         "checkpoints/last holds no complete checkpoint", run="prepared", writes=("run/config.yaml",)),
    Case("resume-truncated-state", train("--resume"), 2, "trainer_state.pt: corrupt trainer state",
         lambda c: truncate(c.run / "checkpoints/last/trainer_state.pt"), run="copy", writes=("run/config.yaml",)),
    Case("resume-pickle-state", train("--resume"), 2,
         "trainer_state.pt: refused to load, the file holds objects that are not plain tensors", pickle_state,
         run="copy", writes=("run/config.yaml",), check=marker_absent),
    Case("non-finite-loss", train(train__lr="1e30", train__warmup_steps=1), 1,
         "training diverged: the loss or weights became NaN/inf at step", run="prepared", writes=("run/config.yaml",),
         check=lambda c, o: not (c.run / "checkpoints/last").exists() or pytest.fail("a diverged model was saved")),
    Case("train-device-cuda", train(train__device="cuda"), 1,
         "device 'cuda' was asked for, but CUDA is not available on this machine", run="copy"),
    Case("sigterm-during-training", train(train__max_steps=100000, train__log_every=1), 143,
         "SIGTERM: saved", run="prepared", writes=("run/",), interrupt=(metrics_written, signal.SIGTERM),
         check=checkpoint_saved_on_sigterm),
    Case("sigkill-during-checkpoint-write", EVERY_STEP, -signal.SIGKILL, "",
         run="prepared", writes=("run/",), interrupt=(killed_during_write, signal.SIGKILL), check=last_checkpoint_loads),
    Case("sigkill-during-checkpoint-switch", EVERY_STEP, -signal.SIGKILL, "",
         run="prepared", writes=("run/",), interrupt=(switching_folders, signal.SIGKILL),
         check=lambda c, o: last_checkpoint_loads(c, o, during_write=False)),  # the switch may end before the kill
    Case("disk-full-while-saving", ("average", "--run-dir", "{run}", "--last", "2"), 1,
         "model.safetensors: File too large; the previous file is unchanged", earlier_average, run="copy",
         limit_file_size=64 * 1024),
    # -- checkpoints and tokenizers
    Case("checkpoint-truncated", TRANSLATE, 2, "best/model.safetensors: not a valid safetensors checkpoint",
         lambda c: truncate(c.run / "checkpoints/best/model.safetensors"), run="copy", stdin=b"Ein Hund.\n"),
    Case("checkpoint-pickle-payload", (*TRANSLATE, "--checkpoint", "{tmp}/evil.safetensors"), 2,
         "evil.safetensors: not a valid safetensors checkpoint", pickle_safetensors, stdin=b"Ein Hund.\n",
         check=marker_absent),
    Case("checkpoint-other-size", (*TRANSLATE, "--checkpoint", "{tmp}/other.safetensors"), 2,
         "(vocabulary {vocab} and d_model 32 in the checkpoint, {vocab} and 64 from the config and tokenizer)",
         smaller_model,
         stdin=b"Ein Hund.\n"),
    Case("checkpoint-other-vocab", (*TRANSLATE, "--checkpoint", "{tmp}/vocab512.safetensors"), 2,
         "(vocabulary 512 and d_model 64 in the checkpoint, {vocab} and 64 from the config and tokenizer)",
         bigger_vocab, stdin=b"Ein Hund.\n"),
    Case("checkpoint-name-missing", (*TRANSLATE, "--checkpoint", "averaged"), 2,
         "checkpoint 'averaged' not found ({run}/checkpoints holds: best, last, step_00000015, step_00000030)",
         stdin=b"Ein Hund.\n"),
    Case("tokenizer-not-sentencepiece", TRANSLATE, 2,
         "tokenizer/joint.model: not a sentencepiece model file; rerun `tcli prepare`",
         lambda c: write(c.run / "tokenizer/joint.model", b"<html>404 Not Found</html>\n"), run="copy", stdin=b"x\n"),
    # -- decoding and scoring
    Case("translate-not-utf8", (*TRANSLATE, "-i", "{tmp}/in.txt", "-o", "{tmp}/out.txt"), 2,
         "in.txt line 2: invalid UTF-8 (byte 4); give UTF-8 text", source_lines("Ein Hund.", b"Stra\xdfe\n"),
         check=lambda c, o: not (c.tmp / "out.txt").exists() or pytest.fail("a partial output was left")),
    Case("translate-line-too-long", ("translate", "--run-dir", "{run}", "-i", "{tmp}/in.txt"), 0,
         "subword tokens, truncated to 255 (model.max_len)",
         source_lines("Ein Hund.", " ".join(["Hund Katze Haus"] * 200), ""), check=translated_in_order),
    Case("translate-line-too-long-quiet", (*TRANSLATE, "-i", "{tmp}/in.txt"), 0,
         "line 2: ",  # --quiet silences progress, never a warning about the user's data
         source_lines("Ein Hund.", " ".join(["Hund Katze Haus"] * 200), ""), check=translated_in_order),
    Case("model-emits-line-break", TRANSLATE, 0, "", line_break_model, run="copy", stdin=b"Ein Hund.\nZwei Katzen.\n",
         check=lambda c, o: len(lines(o.stdout)) == 2 or pytest.fail(f"2 lines in, {o.stdout!r} out")),
    Case("translate-empty-file", (*TRANSLATE, "-i", "{tmp}/in.txt", "-o", "{tmp}/out.txt"), 0, "",
         source_lines(), check=empty_output),
    Case("translate-test-blank-lines", (*TRANSLATE, "-i", "{tiny}/test_2016_flickr.de"), 0, "",
         check=file_translated_aligned),
    Case("eval-test-blank-lines", ("eval", "--run-dir", "{run}", "--json", "--quiet"), 0, "", run="copy",
         writes=("run/hyps/", "run/scores.json"), check=split_aligned),
    Case("encoded-split-pickle-payload", ("eval", "--run-dir", "{run}", "--quiet"), 2,
         "data/test.npz: cannot read the encoded split (This file contains pickled (object) data", pickle_split,
         run="copy", check=marker_absent),
    Case("score-not-utf8", ("score", "--run-dir", "{run}", "-s", "{tmp}/in.txt", "-t", "{tmp}/tgt.txt",
                            "-o", "{tmp}/out.txt"), 2, "tgt.txt: line 2 is not valid UTF-8 (byte 11)", score_bad_target),
    Case("score-empty-files", ("score", "--run-dir", "{run}", "-s", "{tmp}/in.txt", "-t", "{tmp}/in.txt",
                               "-o", "{tmp}/out.txt"), 0,
         "scored 0 pairs", source_lines(), check=empty_output),
    Case("eval-line-count-mismatch", ("eval", "--hyp", "{tmp}/hyp.txt", "--ref", "{tmp}/ref.txt"), 2,
         "hyp.txt has 3 lines but {tmp}/ref.txt has 2; the hypothesis file needs one line per reference line", hyp_ref),
    Case("eval-empty-files", ("eval", "--hyp", "{tmp}/hyp.txt", "--ref", "{tmp}/ref.txt"), 2,
         "{tmp}/ref.txt is empty; there is nothing to score {tmp}/hyp.txt against", empty_hyp_ref),
    Case("output-under-a-file", (*TRANSLATE, "-o", "{tmp}/in.txt/out.txt"), 1,
         "cannot write {tmp}/in.txt/out.txt: {tmp}/in.txt is a file, not a folder", source_lines("Ein Hund."),
         stdin=b"Ein Hund.\n"),
    Case("output-permission-denied", (*TRANSLATE, "-o", "/sys/tcli_robustness.txt"), 1,
         "cannot write /sys/tcli_robustness.txt", stdin=b"Ein Hund.\n"),
    Case("translate-device-cuda", (*TRANSLATE, "--device", "cuda"), 1,
         "device 'cuda' was asked for, but CUDA is not available on this machine; use --device cpu", stdin=b"x\n"),
    Case("plot-broken-metrics", ("plot", "--run-dir", "{run}", "-o", "{tmp}/curves.png"), 2,
         "metrics.jsonl:9: not a JSON line", broken_metrics, run="copy",
         check=lambda c, o: not (c.tmp / "curves.png").exists() or pytest.fail("a plot was written")),
    Case("resume-broken-metrics", train("--resume"), 2, "metrics.jsonl:9: not a JSON line", broken_metrics,
         run="copy", writes=("run/config.yaml",)),
    Case("sigterm-during-translate-output", (*TRANSLATE, "-i", "{tiny}/train.de", "-o", "{tmp}/out.txt"), 143,
         "error: terminated by SIGTERM; files being written were discarded", interrupt=(translating_to_file, signal.SIGTERM),
         check=lambda c, o: not (c.tmp / "out.txt").exists() or pytest.fail("a partial output was left")),
    Case("sigint-during-translate-output", (*TRANSLATE, "-i", "{tiny}/train.de", "-o", "{tmp}/out.txt"), 130,
         "error: interrupted (Ctrl-C); files being written were discarded",
         interrupt=(translating_to_file, signal.SIGINT),
         check=lambda c, o: not (c.tmp / "out.txt").exists() or pytest.fail("a partial output was left")),
    Case("download-corrupt", ("download", "multi30k", "--dest", "{tmp}/dl", "--base-url", "file://{tmp}/mirror", "-q"), 1,
         "does not match the expected", corrupt_mirror,
         check=lambda c, o: not (c.tmp / "dl/train.de.gz").exists() or pytest.fail("a corrupt file was kept")),
    Case("attention-bad-layer", ("attention", "--run-dir", "{run}", "--text", "Ein Hund.", "--layer", "7", "-o",
                                 "{tmp}/a.png"), 2, "--layer must be 'all' or a number from 1 to 2, got '7'"),
    Case("debug-shows-traceback", ("--debug", "config", "-c", "{tmp}/nope.yaml"), 2, "nope.yaml: config file not found",
         traceback=True),
    Case("average-too-few", ("average", "--run-dir", "{run}", "--last", "5"), 2,
         "holds 2 usable step_* checkpoints, 5 were asked for"),
]


# ----------------------------------------------------------------------------- running a row


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under the roots, keyed by path."""
    out = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def execute(case: Case, tmp: Path, trained: Path, tiny: Path) -> tuple[Ctx, Outcome]:
    """Prepare the row's folders, run tcli (interrupting it if the row says so), snapshot before/after."""
    run = trained
    if case.run != "shared":
        run = tmp / "run"
        if case.run == "copy":
            shutil.copytree(trained, run)
        else:
            run.mkdir()
            for name in ("config.yaml", "data", "tokenizer"):
                (shutil.copytree if (trained / name).is_dir() else shutil.copy)(trained / name, run / name)
    ctx = Ctx(tmp, run, tiny)
    if case.setup:
        case.setup(ctx)
    roots = (tmp,) if case.run != "shared" else (tmp, trained)
    before = snapshot(*roots)
    args = [ctx.fmt(a) for a in case.args]

    def limits():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background job inherits SIGINT ignored; a terminal does not
        if case.limit_file_size:
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.limit_file_size, case.limit_file_size))

    proc = subprocess.Popen([sys.executable, "-m", "transformer_cli", *args], cwd=ROOT, env=ENV,
                            stdin=subprocess.DEVNULL if case.interrupt else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limits)
    if case.interrupt:
        when, sig = case.interrupt
        deadline = time.monotonic() + 300
        while not when(ctx):
            assert proc.poll() is None, f"tcli ended before the signal: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "timed out waiting to interrupt tcli"
            time.sleep(0.001)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
    else:
        stdout, stderr = proc.communicate(case.stdin or b"", timeout=300)
    out = Outcome(proc.returncode, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), before,
                  snapshot(*roots))
    return ctx, out


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, trained, tiny):
    """The selected rows started in a small thread pool (subprocesses mostly wait for imports); futures by id."""
    selected = {item.callspec.params["case"].id for item in request.session.items
                if getattr(item, "originalname", "") == "test_robustness"}
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {c.id: pool.submit(execute, c, tmp_path_factory.mktemp(c.id), trained, tiny)
               for c in CASES if c.id in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_crafted_files_do_run_code_when_loaded_unsafely(tmp_path):
    """The marker checks mean something: an unsafe loader would create the marker from these payloads."""
    import torch
    import yaml

    ctx = Ctx(tmp_path, tmp_path, tmp_path)
    pickle.loads(pickle.dumps(Payload(tmp_path / "MARKER")))
    assert (tmp_path / "MARKER").exists()
    (tmp_path / "MARKER").unlink()
    python_tag_yaml(ctx)
    yaml.unsafe_load((tmp_path / "evil.yaml").read_text())
    assert (tmp_path / "MARKER").exists()
    (tmp_path / "MARKER").unlink()
    (tmp_path / "checkpoints/last").mkdir(parents=True)
    pickle_state(ctx)
    torch.load(tmp_path / "checkpoints/last/trainer_state.pt", weights_only=False)
    assert (tmp_path / "MARKER").exists()


def test_table_is_large_and_ids_unique():
    assert len(CASES) >= 25 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_robustness(case: Case, outcomes):
    ctx, out = outcomes[case.id].result()
    assert ("Traceback" in out.stderr) == case.traceback, out.stderr
    assert out.code == case.code, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    if case.code in (1, 2, 130, 143) and case.message.startswith("error: "):
        assert ctx.fmt(case.message) == errors[0] and len(errors) == 1, out.stderr
    elif case.code in (1, 2):
        assert len(errors) == 1 and out.stderr.rstrip("\n").endswith(errors[0]), out.stderr  # one line, last
        assert ctx.fmt(case.message) in errors[0], errors[0]
    else:
        assert errors == [], out.stderr
        assert ctx.fmt(case.message) in out.stderr, out.stderr
    damaged = [p for p, digest in out.before.items() if out.after.get(p) != digest
               and not any(p.startswith(str(ctx.tmp / w)) for w in case.writes)]
    assert damaged == [], f"files changed or removed: {damaged}"
    if case.code != -signal.SIGKILL:
        leftovers = [p for p in out.after if ".tmp" in Path(p).name or ".tmp/" in p or ".old/" in p]
        assert leftovers == [], f"temporary files left behind: {leftovers}"
    if case.check:
        case.check(ctx, out)
