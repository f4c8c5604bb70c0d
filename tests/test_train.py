"""`tcli train` end to end on a tiny slice of Multi30k: learning, exact resume after SIGKILL, SIGTERM,
refusals, divergence, plot and average. One uninterrupted baseline run is shared by the tests."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from transformer_cli.errors import ConfigError, DataError
from transformer_cli.plots import read_metrics

from .conftest import ROOT, run_tcli

VOCAB = 500


def tiny_settings(data: Path) -> list[str]:
    """Overrides of configs/smoke.yaml: 2,000 training pairs, 1,024-token batches (~70 per epoch), 45 updates."""
    sets = {
        "data.path": data, "data.max_train_pairs": 0, "tokenizer.vocab_size": VOCAB,
        "train.max_tokens": 1024, "train.max_steps": 45, "train.valid_every": 15, "train.log_every": 5,
        "train.warmup_steps": 10, "train.threads": 1, "train.keep_last": 5, "decode.max_len_b": 3,
    }
    return [w for k, v in sets.items() for w in ("--set", f"{k}={v}")]


def train_args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "--config", "configs/smoke.yaml", "--run-dir", str(run_dir), *tiny_settings(data), *extra]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, multi30k) -> Path:
    """The first 2,000 training and 150 validation lines of Multi30k de-en, in a temp folder."""
    folder = tmp_path_factory.mktemp("tiny_multi30k")
    for split, count in (("train", 2000), ("val", 150), ("test_2016_flickr", 20)):
        for lang in ("de", "en"):
            with gzip.open(multi30k / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [next(f) for _ in range(count)]
            (folder / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_data) -> Path:
    """An uninterrupted run; its data/ and tokenizer/ are copied into the other runs' dirs."""
    run_dir = tmp_path_factory.mktemp("runs") / "baseline"
    result = run_tcli(*train_args(run_dir, tiny_data))
    assert result.returncode == 0, result.stderr
    return run_dir


def prepared_copy(baseline: Path, dest: Path) -> Path:
    """A run dir holding the baseline's prepared data and tokenizer only (no training yet)."""
    for name in ("data", "tokenizer"):
        shutil.copytree(baseline / name, dest / name)
    return dest


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records; none before the first is written."""
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []


def start(run_dir: Path, data: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "transformer_cli", *train_args(run_dir, data, *extra)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, condition, timeout: float = 300) -> None:
    """Poll until condition() holds; fail if the process ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"training ended before the test could interrupt it:\n{proc.stderr.read()}"
        assert time.monotonic() < deadline, "timed out waiting for training progress"
        time.sleep(0.02)


def final_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "checkpoints" / "last" / "model.safetensors"))


def bitwise_equal(a: dict, b: dict) -> bool:
    """Same tensor names and every tensor equal bit for bit (file bytes differ: safetensors' metadata order is not fixed)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_lowers_valid_loss(baseline):
    valid = [r for r in metrics(baseline) if "valid_loss" in r]
    assert [r["step"] for r in valid] == [15, 30, 45]
    losses = [r["valid_loss"] for r in valid]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.2
    assert valid[-1]["valid_loss"] < math.log(VOCAB) - 1.5  # a uniform guess costs ln V per token
    assert valid[-1]["valid_ppl"] == pytest.approx(math.exp(valid[-1]["valid_loss"]), rel=1e-3)
    assert {"valid_bleu", "valid_chrf"} <= set(valid[-1])
    train = [r for r in metrics(baseline) if "train_loss" in r]
    assert [r["step"] for r in train] == list(range(5, 46, 5))
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in train)
    ckpts = sorted(p.name for p in (baseline / "checkpoints").iterdir())
    assert ckpts == ["best", "last", "step_00000015", "step_00000030", "step_00000045"]


def test_sigkill_then_resume_is_bitwise_identical(baseline, tiny_data, tmp_path):
    run_dir = prepared_copy(baseline, tmp_path / "killed")
    proc = start(run_dir, tiny_data)
    state = run_dir / "checkpoints" / "last" / "trainer_state.pt"
    wait_for(proc, lambda: state.is_file() and any(r["step"] >= 20 for r in metrics(run_dir)))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    progress = torch.load(state, weights_only=True)["progress"]
    assert progress["step"] == 15 and progress["epoch"] == 1 and progress["position"] == 15  # mid-epoch
    resumed = run_tcli(*train_args(run_dir, tiny_data, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert bitwise_equal(final_weights(run_dir), final_weights(baseline))
    assert [r["step"] for r in metrics(run_dir)] == [r["step"] for r in metrics(baseline)]  # no duplicates


def test_sigterm_saves_checkpoint_and_exits_143(baseline, tiny_data, tmp_path):
    run_dir = prepared_copy(baseline, tmp_path / "term")
    proc = start(run_dir, tiny_data)
    wait_for(proc, lambda: any(r["step"] >= 5 for r in metrics(run_dir)))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "resume with:" in err and "--resume" in err
    info = json.loads((run_dir / "checkpoints" / "last" / "info.json").read_text())
    assert 5 <= info["step"] < 45 and json.loads(out)["step"] == info["step"]
    resumed = run_tcli(*train_args(run_dir, tiny_data, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert bitwise_equal(final_weights(run_dir), final_weights(baseline))


def in_process(run_dir: Path, data: Path, *sets: str, **kw):
    """Call train.train directly (no interpreter start-up) with the tiny settings plus `sets`."""
    from transformer_cli.config import load_config
    from transformer_cli.train import train

    words = tiny_settings(data) + [w for x in sets for w in ("--set", x)]
    cfg = load_config(ROOT / "configs" / "smoke.yaml", words[1::2])
    threads = torch.get_num_threads()
    try:
        return train(cfg, run_dir, quiet=True, **kw)
    finally:
        torch.set_num_threads(threads)  # train.threads must not leak into later tests


def test_subword_sampling_trains_and_resumes_on_the_saved_sample(baseline, tiny_data, tmp_path):
    """With train.subword_alpha every epoch trains on a new sample saved in subword/; two copies of a run
    stopped mid-epoch both resume on that saved sample, so they end bitwise equal."""
    # validation only at the end of each run: an early model's greedy decodes run to max length and cost seconds
    sampling = ["train.subword_alpha=0.1", "train.subword_nbest=64", "train.valid_every=100"]
    whole = prepared_copy(baseline, tmp_path / "whole")
    result = run_tcli(*train_args(whole, tiny_data, *[w for x in sampling for w in ("--set", x)],
                                  "--set", "train.max_steps=100"))
    assert result.returncode == 0, result.stderr
    assert "subword sampling: epoch 1 resampled" in result.stderr and "epoch 2 resampled" in result.stderr
    assert metrics(whole)[-1]["epoch"] == 2
    assert sorted(p.name for p in (whole / "subword").iterdir()) == ["epoch_00001.npz", "epoch_00002.npz"]
    assert not bitwise_equal(final_weights(whole), final_weights(baseline))  # the option changes the data

    stopped = prepared_copy(baseline, tmp_path / "stopped")
    in_process(stopped, tiny_data, *sampling, "train.max_steps=20")
    twin = tmp_path / "twin"
    shutil.copytree(stopped, twin)
    for run_dir in (stopped, twin):  # each resume would draw a different sample if it did not reload the saved one
        in_process(run_dir, tiny_data, *sampling, "train.max_steps=40", resume=True)
    assert metrics(stopped)[-1]["epoch"] == 1
    assert bitwise_equal(final_weights(stopped), final_weights(twin))
    assert run_tcli(*train_args(stopped, tiny_data, "--overwrite", "--set", "train.max_steps=1")).returncode == 0
    assert not (stopped / "subword").exists()  # --overwrite without sampling leaves no stale samples behind


def test_rdrop_without_dropout_trains_like_plain_cross_entropy(baseline, tiny_data, tmp_path):
    """R-Drop runs each batch twice; with no dropout the passes agree, the KL term is 0 and the mean CE of
    the two is the plain CE, so the weights match a plain run (up to float sums over a twice-as-large batch).
    With dropout the passes differ, so the KL weight changes the run (same seed, same dropout masks). Adam's
    eps = 1 makes its steps ~ lr * gradient: with the usual tiny eps, coordinates whose gradient is float
    noise (~0) take full +-lr steps either way."""
    off = ["model.dropout=0", "model.attention_dropout=0", "train.max_steps=4", "train.eps=1", "train.lr=1",
           "train.log_every=1"]
    runs = {}
    for name, extra in (("plain", []), ("rdrop", ["train.rdrop_alpha=3"]),
                        ("alpha_3", ["train.rdrop_alpha=3", "model.dropout=0.1"]),
                        ("alpha_30", ["train.rdrop_alpha=30", "model.dropout=0.1"])):
        runs[name] = prepared_copy(baseline, tmp_path / name)
        in_process(runs[name], tiny_data, *off, *extra)
    plain, rdrop = final_weights(runs["plain"]), final_weights(runs["rdrop"])
    assert plain.keys() == rdrop.keys()
    assert max((plain[k] - rdrop[k]).abs().max().item() for k in plain) < 1e-5
    weak, strong = final_weights(runs["alpha_3"]), final_weights(runs["alpha_30"])
    assert max((weak[k] - strong[k]).abs().max().item() for k in weak) > 1e-3  # fails if training ignores R-Drop
    losses = {name: [r["train_loss"] for r in metrics(run) if "train_loss" in r] for name, run in runs.items()}
    assert len(losses["plain"]) == 4 and losses["rdrop"] == pytest.approx(losses["plain"], rel=1e-5)


def test_bidirectional_epochs_train_on_reversed_pairs_then_stop(baseline, tiny_data, tmp_path):
    """train.bidirectional_epochs=1: epoch 1 holds every pair and every pair reversed (about twice the
    batches), epoch 2 the pairs only; the run differs from a plain one and resumes bit-exactly inside
    the doubled epoch."""
    from transformer_cli.config import load_config
    from transformer_cli.train import Dist, Trainer

    bit = ["train.bidirectional_epochs=1"]
    cfg = load_config(ROOT / "configs" / "smoke.yaml", (tiny_settings(tiny_data) + ["--set", bit[0]])[1::2])
    trainer = Trainer(cfg, baseline, Dist(device=torch.device("cpu")), quiet=True, resume_command="")
    plain, both = trainer.train_split, trainer.epoch_split(1)
    n = len(plain)
    assert len(both) == 2 * n and trainer.epoch_split(2) is plain
    for i in (0, n // 2, n - 1):
        assert both.src[i].tolist() == plain.src[i].tolist() and both.tgt[i].tolist() == plain.tgt[i].tolist()
        assert both.src[n + i].tolist() == plain.tgt[i].tolist() and both.tgt[n + i].tolist() == plain.src[i].tolist()
    assert abs(len(trainer.epoch_batches(1)) - 2 * len(trainer.epoch_batches(2))) <= 2

    runs = {name: prepared_copy(baseline, tmp_path / name) for name in ("plain", "whole", "stopped")}
    in_process(runs["plain"], tiny_data, "train.max_steps=30")
    in_process(runs["whole"], tiny_data, *bit, "train.max_steps=30")
    in_process(runs["stopped"], tiny_data, *bit, "train.max_steps=15")
    in_process(runs["stopped"], tiny_data, *bit, "train.max_steps=30", resume=True)
    assert metrics(runs["whole"])[-1]["epoch"] == 1  # still inside the doubled first epoch
    assert not bitwise_equal(final_weights(runs["whole"]), final_weights(runs["plain"]))
    assert bitwise_equal(final_weights(runs["stopped"]), final_weights(runs["whole"]))


def test_right_to_left_run_trains_on_reversed_targets_and_writes_text_front_to_back(baseline, tiny_data, tmp_path):
    """data.target_order=r2l: prepare keeps the tokenizer and stores every target back to front (sources as
    they were); the trained model's subwords come out last-first, and translate, score and the attention
    labels turn them round through the tokenizer; an ensemble with a left-to-right run is refused."""
    from transformer_cli.data import load_split
    from transformer_cli.scoring import score_ids
    from transformer_cli.translator import Translator

    r2l = prepared_copy(baseline, tmp_path / "r2l")
    in_process(r2l, tiny_data, "data.target_order=r2l", "train.max_steps=30")
    assert (r2l / "tokenizer" / "joint.model").read_bytes() == (baseline / "tokenizer" / "joint.model").read_bytes()
    assert json.loads((r2l / "data" / "meta.json").read_text())["summary"]["tokenizer"] == "reused"
    for name in ("train", "valid"):
        plain, back = load_split(baseline, name), load_split(r2l, name)
        assert len(plain) == len(back) and back.tgt_text == plain.tgt_text
        for i in (0, len(plain) // 2, len(plain) - 1):
            assert back.src[i].tolist() == plain.src[i].tolist()
            assert back.tgt[i].tolist() == plain.tgt[i].tolist()[::-1] != plain.tgt[i].tolist()

    translator = Translator.from_run_dir(r2l, "last", device="cpu", decode={"beam": 1})
    source = load_split(r2l, "valid").src_text[0]
    shown = translator.attention(source)
    pieces = shown["tgt_pieces"][:-1]  # the model's order, then </s>
    assert len(pieces) > 1 and shown["translation"] == "".join(reversed(pieces)).replace("\u2581", " ").strip()
    assert translator.translate([source]) == [shown["translation"]]
    target = load_split(r2l, "valid").tgt_text[0]
    plain_tok = Translator.from_run_dir(baseline, "last", device="cpu").tokenizer
    ids = plain_tok.encode_tgt([target])[0]
    how = (translator.device, translator.decode_cfg.precision)
    expected = score_ids(translator.model, translator.encode([source]), [ids[::-1]], *how)
    forward = score_ids(translator.model, translator.encode([source]), [ids], *how)
    (got, length), = translator.score([source], [target])
    assert length == len(ids) + 1 and got == pytest.approx(expected[0], abs=1e-5) and got != pytest.approx(forward[0])
    with pytest.raises(ConfigError, match="an ensemble needs one order"):
        Translator.from_run_dir(r2l, "last", device="cpu", ensemble=[baseline])


def test_word_dropout_changes_the_run_and_resumes_bit_exactly(baseline, tiny_data, tmp_path):
    """model.word_dropout draws from torch's global generator, which the trainer state saves: a run
    stopped at step 15 and resumed ends with the uninterrupted run's weights, and both differ from a
    run without word dropout."""
    wd = ["model.word_dropout=0.2"]
    runs = {name: prepared_copy(baseline, tmp_path / name) for name in ("plain", "whole", "stopped")}
    in_process(runs["plain"], tiny_data, "train.max_steps=30")
    in_process(runs["whole"], tiny_data, *wd, "train.max_steps=30")
    in_process(runs["stopped"], tiny_data, *wd, "train.max_steps=15")
    in_process(runs["stopped"], tiny_data, *wd, "train.max_steps=30", resume=True)
    assert not bitwise_equal(final_weights(runs["whole"]), final_weights(runs["plain"]))
    assert bitwise_equal(final_weights(runs["stopped"]), final_weights(runs["whole"]))


def test_init_from_fine_tunes_a_trained_run_with_its_tokenizer(baseline, tiny_data, tmp_path):
    """train.init_from: the new run copies the source run's tokenizer (its settings replace the config's),
    starts from the source's best weights bit for bit, with a fresh step count, so its first losses are
    those of a trained model; a wrong path or another architecture is a clear error."""
    from transformer_cli.config import load_config
    from transformer_cli.train import Dist, Trainer

    ft = tmp_path / "ft"
    summary = in_process(ft, tiny_data, f"train.init_from={baseline}", "tokenizer.vocab_size=300",
                         "train.max_steps=5", "train.valid_every=5")
    assert summary["step"] == 5
    assert (ft / "tokenizer" / "joint.model").read_bytes() == (baseline / "tokenizer" / "joint.model").read_bytes()
    assert json.loads((ft / "tokenizer" / "tokenizer.json").read_text())["init_from"] == str(baseline)
    saved = load_config(ft / "config.yaml")
    assert saved.tokenizer.vocab_size == VOCAB and saved.train.init_from == str(baseline)
    shown = run_tcli("config", "--config", "configs/smoke.yaml", "--set", f"train.init_from={baseline}",
                     "--set", "tokenizer.vocab_size=300")
    assert shown.returncode == 0 and f"vocab_size: {VOCAB}\n" in shown.stdout, shown.stderr
    scratch, tuned = metrics(baseline)[0], metrics(ft)[0]
    assert scratch["step"] == tuned["step"] == 5
    assert tuned["train_loss"] < scratch["train_loss"] - 1.5, (tuned, scratch)

    base = shutil.copytree(baseline, tmp_path / "base")  # a source run that goes away after the copy
    gone = tmp_path / "gone"
    started = run_tcli(*train_args(gone, tiny_data, "--init-from", str(base), "--set", "train.max_steps=5"))
    assert started.returncode == 0 and "initialised from" in started.stderr, started.stderr
    shutil.rmtree(base)
    in_process(gone, tiny_data, f"train.init_from={base}", "train.max_steps=8", resume=True)  # the run's copy stands in
    assert metrics(gone)[-1]["step"] == 8

    cfg = load_config(ft / "config.yaml")
    trainer = Trainer(cfg, ft, Dist(device=torch.device("cpu")), quiet=True, resume_command="")
    best = baseline / "checkpoints" / "best"
    stored = load_file(str(best / "model.safetensors"))  # tied embeddings: stored once
    own = trainer.model.state_dict()
    assert not any(torch.equal(own[k], v) for k, v in stored.items() if "weight" in k and v.dim() == 2)
    trainer.initialise_from(str(best))
    assert all(torch.equal(own[k], v) for k, v in stored.items())

    with pytest.raises(DataError, match="is not a run dir, a checkpoint folder or a .safetensors file"):
        in_process(tmp_path / "x", tiny_data, f"train.init_from={tmp_path / 'nothing'}")
    with pytest.raises(DataError, match=r"train.init_from: .*tensor .* its model section must match"):
        in_process(tmp_path / "y", tiny_data, f"train.init_from={best}", "model.d_model=32")
    alone = tmp_path / "alone.safetensors"
    shutil.copy(best / "model.safetensors", alone)
    with pytest.raises(DataError, match="fine-tuning needs the tokenizer"):
        in_process(tmp_path / "z", tiny_data, f"train.init_from={alone}")


def test_refusals(baseline, tiny_data, tmp_path):
    other = run_tcli(*train_args(baseline, tiny_data, "--set", "model.d_model=32"))  # through the CLI: exit 2
    assert other.returncode == 2 and "different config (model.d_model: 64 -> 32)" in other.stderr
    with pytest.raises(ConfigError, match="already holds a training run; pass --resume"):
        in_process(baseline, tiny_data)
    empty = prepared_copy(baseline, tmp_path / "empty")
    with pytest.raises(DataError, match="holds no complete checkpoint"):
        in_process(empty, tiny_data, resume=True)
    with pytest.raises(ConfigError, match="fp16, which needs a CUDA device"):
        in_process(empty, tiny_data, "train.precision=fp16", "train.device=cpu")
    with pytest.raises(ConfigError, match="set at least one of train.max_steps"):
        in_process(empty, tiny_data, "train.max_steps=0")


def test_resume_names_the_changed_key_and_accepts_checkpoints_older_than_a_new_key(baseline, tiny_data, tmp_path):
    """trainer_state.pt stores the run's training keys: --resume names the one that changed, and a key added
    to tcli later (absent from the checkpoint) is accepted at its default. Older checkpoints held only a
    hash computed without such keys; they resume too, as a 2-hour run from before bidirectional_epochs must."""
    from transformer_cli import checkpoint as ck
    from transformer_cli.config import from_dict, read_yaml
    from transformer_cli.train import KEYS_AFTER_HASH_ONLY, _hash, checkpoint_difference, identity

    run = tmp_path / "old"
    shutil.copytree(baseline, run)
    state_path = run / "checkpoints" / "last" / ck.STATE
    state = torch.load(state_path, weights_only=True)
    assert state["config"]["model.d_model"] == 64
    state["config"]["model.dropout"] = 0.5  # as if trained with another dropout
    torch.save(state, state_path)
    with pytest.raises(ConfigError, match=r"differs from the checkpoint's \(model.dropout: 0.5 -> 0.1\)"):
        in_process(run, tiny_data, "train.max_steps=50", resume=True)

    keys = dict(state["config"], **{"model.dropout": 0.1})
    for key in KEYS_AFTER_HASH_ONLY:  # train.bidirectional_epochs, train.init_from, ...
        del keys[key]
    legacy = {k: v for k, v in state.items() if k != "config"}
    legacy["config_hash"] = _hash(keys)  # what a checkpoint from before the key stored
    assert "train.bidirectional_epochs" in KEYS_AFTER_HASH_ONLY
    cfg = from_dict(read_yaml(run / "config.yaml"), "config.yaml")
    assert checkpoint_difference(legacy, cfg) is None
    cfg.train.bidirectional_epochs = 1  # the new key away from its default: not what the hash was made of
    assert checkpoint_difference(legacy, cfg) == "a training key"
    assert checkpoint_difference(dict(legacy, config_hash=_hash(identity(cfg))), cfg) is None
    cfg.train.bidirectional_epochs = 0
    bit_era = {k: v for k, v in identity(cfg).items() if k != "train.init_from"}  # knew only the first key
    assert checkpoint_difference(dict(legacy, config_hash=_hash(bit_era)), cfg) is None
    torch.save(legacy, state_path)
    in_process(run, tiny_data, "train.max_steps=50", resume=True)
    assert metrics(run)[-1]["step"] == 50
    assert torch.load(state_path, weights_only=True)["config"]["train.bidirectional_epochs"] == 0


def test_busy_run_dir_is_refused_even_with_overwrite(baseline, tiny_data):
    """While one process trains in a run dir, a second `tcli train` there exits 1 and deletes nothing."""
    from transformer_cli.train import run_dir_lock

    before = sorted(p.name for p in (baseline / "checkpoints").iterdir())
    with run_dir_lock(baseline):  # stands in for a training in progress
        second = run_tcli(*train_args(baseline, tiny_data, "--overwrite"))
    assert second.returncode == 1, second.stderr
    assert f"{baseline} is in use by another `tcli train`" in second.stderr
    assert sorted(p.name for p in (baseline / "checkpoints").iterdir()) == before  # --overwrite deleted nothing
    with run_dir_lock(baseline):  # released when the holder ended: free again
        pass


def test_divergence_stops_without_writing_nan(baseline, tiny_data, tmp_path):
    run_dir = prepared_copy(baseline, tmp_path / "nan")
    result = run_tcli(*train_args(run_dir, tiny_data, "--set", "train.lr=1e30", "--set", "train.warmup_steps=1",
                                  "--set", "train.clip_norm=0"))
    assert result.returncode == 1, result.stderr
    assert "diverged" in result.stderr and "at step" in result.stderr
    assert not (run_dir / "checkpoints" / "last").exists()


def test_plot_and_average(baseline, tmp_path):
    png = tmp_path / "curves.png"
    result = run_tcli("plot", "--run-dir", baseline, "-o", png)
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = run_tcli("average", "--run-dir", baseline, "--last", "2")
    assert result.returncode == 0, result.stderr
    avg = load_file(str(baseline / "checkpoints" / "averaged" / "model.safetensors"))
    a = load_file(str(baseline / "checkpoints" / "step_00000030" / "model.safetensors"))
    b = load_file(str(baseline / "checkpoints" / "step_00000045" / "model.safetensors"))
    for key in a:
        assert (avg[key] - (a[key] + b[key]) / 2).abs().max() < 1e-6


def test_precision_auto_trains_as_the_precision_it_resolves_to(baseline, tiny_data, tmp_path):
    """train.precision=auto is resolved once per run (bf16 with native bf16, else fp32) and trains exactly as that."""
    from transformer_cli.device import resolve_precision

    resolved, _ = resolve_precision("auto", torch.device("cpu"), "train.precision")
    runs = {name: prepared_copy(baseline, tmp_path / name) for name in ("auto", "explicit", "other")}
    other = "fp32" if resolved == "bf16" else "bf16"
    summaries = {name: in_process(runs[name], tiny_data, f"train.precision={precision}", "train.max_steps=3")
                 for name, precision in (("auto", "auto"), ("explicit", resolved), ("other", other))}
    assert summaries["auto"]["precision"] == resolved and summaries["other"]["precision"] == other
    assert bitwise_equal(final_weights(runs["auto"]), final_weights(runs["explicit"]))
    assert not bitwise_equal(final_weights(runs["auto"]), final_weights(runs["other"]))


def test_ema_checkpoint_tracks_training_resumes_exactly_and_evaluates(baseline, tiny_data, tmp_path):
    """train.ema_decay writes checkpoints/ema: a run stopped at step 15 and resumed ends with the
    uninterrupted run's moving average bit for bit; it differs from the last weights, a tiny decay makes
    it the last weights, and `tcli eval --checkpoint ema` decodes with it."""
    ema = ["train.ema_decay=0.9"]
    runs = {name: prepared_copy(baseline, tmp_path / name) for name in ("whole", "stopped", "tiny")}
    in_process(runs["whole"], tiny_data, *ema, "train.max_steps=30")
    in_process(runs["stopped"], tiny_data, *ema, "train.max_steps=15")
    in_process(runs["stopped"], tiny_data, *ema, "train.max_steps=30", resume=True)
    in_process(runs["tiny"], tiny_data, "train.ema_decay=1e-6", "train.max_steps=15")

    def ema_weights(run_dir: Path) -> dict:
        return load_file(str(run_dir / "checkpoints" / "ema" / "model.safetensors"))

    whole = ema_weights(runs["whole"])
    assert bitwise_equal(ema_weights(runs["stopped"]), whole)
    assert not bitwise_equal(whole, final_weights(runs["whole"]))
    assert json.loads((runs["whole"] / "checkpoints" / "ema" / "info.json").read_text())["step"] == 30
    tiny, last = ema_weights(runs["tiny"]), final_weights(runs["tiny"])
    assert tiny.keys() == last.keys() and all(torch.allclose(tiny[k], last[k], atol=1e-5) for k in tiny)
    result = run_tcli("eval", "--run-dir", str(runs["whole"]), "--checkpoint", "ema", "--beam", "1")
    assert result.returncode == 0, result.stderr
    assert "bleu" in result.stdout.lower()


def test_cosine_cycles_keep_a_snapshot_at_each_cycle_end_that_decode_as_an_ensemble(baseline, tiny_data, tmp_path):
    """train.cycles=3 over 45 updates validates and keeps checkpoints/cycle_K at updates 15, 30, 45 (the
    floor of each restarted cosine); the last snapshot is the final weights; the three decode together."""
    run_dir = prepared_copy(baseline, tmp_path / "cycles")
    in_process(run_dir, tiny_data, "train.schedule=cosine", "train.min_lr=1e-5", "train.cycles=3",
               "train.valid_every=20")
    root = run_dir / "checkpoints"
    steps = [json.loads((root / f"cycle_{k}" / "info.json").read_text())["step"] for k in (1, 2, 3)]
    assert steps == [15, 30, 45]
    assert {15, 20, 30, 40, 45} <= {m["step"] for m in metrics(run_dir) if "valid_bleu" in m}  # cycle ends validated too
    snapshots = [load_file(str(root / f"cycle_{k}" / "model.safetensors")) for k in (1, 2, 3)]
    assert bitwise_equal(snapshots[2], final_weights(run_dir))
    assert not bitwise_equal(snapshots[0], snapshots[1])
    result = run_tcli("eval", "--run-dir", str(run_dir), "--checkpoint", "cycle_3", "--beam", "1",
                      "--ensemble", str(root / "cycle_1"), "--ensemble", str(root / "cycle_2"))
    assert result.returncode == 0, result.stderr
    assert (run_dir / "hyps" / "test.cycle_3.beam1.ensemble3.txt").is_file()
