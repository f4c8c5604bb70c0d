"""Training: `tcli train`. Token batches -> label-smoothed CE -> torch.optim, validation, checkpoints.

One update = `update_freq` micro-batches on each of `world` ranks. The batches of an epoch come
from `batching.token_batches(seed, epoch)`, so the data order is a pure function of (seed, epoch)
and a checkpoint only needs the position inside the epoch to resume at the exact next batch.
Update u of an epoch uses batches [u*W*F, (u+1)*W*F); rank r takes every W-th of them
(batches[r::W]). Gradients are scaled by world / (target tokens of the whole update), so the
loss is per target token of the global batch whatever the split between ranks and micro-batches.

Validation runs on rank 0 only; it saves and restores the RNG state around itself, so validating
never changes the training trajectory. Every checkpoint write is atomic (checkpoint.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import queue
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import checkpoint as ck
from .config import Config, from_dict, read_yaml
from .device import autocast, resolve_device, resolve_precision
from .ema import EMA
from .errors import ConfigError, DataError, TcliError
from .io_utils import atomic_write_text
from .loss import rdrop_loss_sum, token_loss_sum
from .schedule import build_optimizer, build_scheduler, cycle_ends

# Keys that may change between a run and its --resume: limits, logging, decoding, where it runs.
RESUMABLE_KEYS = {
    "run_dir", "train.max_steps", "train.max_epochs", "train.max_minutes", "train.patience",
    "train.valid_every", "train.log_every", "train.keep_best", "train.keep_last", "train.device",
    "train.threads", "train.valid_beam", "train.compile",
}
RESUMABLE_SECTIONS = {"decode", "eval"}
RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "tensorboard", "training.png", "subword")


@dataclass
class Progress:
    """Counters saved with every checkpoint (plain numbers: loadable with weights_only)."""

    step: int = 0  # updates done
    epoch: int = 1  # the epoch being trained (1-based)
    position: int = 0  # batches of this epoch (all ranks together) already used
    best_score: float | None = None
    best_step: int = 0
    bad_validations: int = 0  # validations since the last improvement (early stopping)
    last_valid_step: int = 0
    wall_s: float = 0.0  # training seconds over all runs of this run dir


# ---------------------------------------------------------------- config identity and run dir


def flat_config(cfg: Config) -> dict:
    """{"section.key": value} for every key."""
    out = {}
    for key, value in cfg.to_dict().items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def identity(cfg: Config) -> dict:
    """The keys that define a run (everything but limits, logging and decoding)."""
    return {k: v for k, v in flat_config(cfg).items()
            if k not in RESUMABLE_KEYS and k.split(".")[0] not in RESUMABLE_SECTIONS}


def _hash(keys: dict) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def config_hash(cfg: Config) -> str:
    """A short hash of identity(cfg), stored in trainer_state.pt."""
    return _hash(identity(cfg))


# Keys added while trainer_state.pt held only config_hash, oldest first: such a checkpoint still resumes
# while they keep their defaults (its hash was computed without the keys added after it).
KEYS_AFTER_HASH_ONLY = ("train.bidirectional_epochs", "train.init_from")


def checkpoint_difference(state: dict, cfg: Config) -> str | None:
    """'key: saved -> now' when cfg is not the config a checkpoint was trained with, else None.
    A key the checkpoint does not know (added to tcli since) matches while it holds its default."""
    now, defaults = identity(cfg), identity(Config())
    saved = state.get("config")
    if saved is None:  # older checkpoints store only the hash
        hashes = []
        for i in range(len(KEYS_AFTER_HASH_ONLY) + 1):  # the checkpoint knew the keys before i
            later = KEYS_AFTER_HASH_ONLY[i:]
            hashes.append(_hash({k: v for k, v in now.items() if not (k in later and v == defaults[k])}))
        return None if state.get("config_hash") in hashes else "a training key"
    for key in sorted(now.keys() | saved.keys()):
        old, new = saved.get(key, defaults.get(key)), now.get(key, defaults.get(key))
        if old != new:
            return f"{key}: {old!r} -> {new!r}"
    return None


def first_difference(old: Config, new: Config) -> str | None:
    """'key: old -> new' for the first identity key that differs, or None."""
    a, b = identity(old), identity(new)
    for key in a:
        if a[key] != b.get(key):
            return f"{key}: {a[key]!r} -> {b.get(key)!r}"
    return None


def check_run_dir(cfg: Config, run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to start over a finished or different run unless --resume or --overwrite says so."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: pick one")
    has_run = any((run_dir / name).exists() for name in RUN_ARTIFACTS)
    if overwrite:
        for name in RUN_ARTIFACTS:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        return
    saved = run_dir / "config.yaml"
    old = from_dict(read_yaml(saved), str(saved)) if saved.is_file() and has_run else None
    diff = first_difference(old, cfg) if old is not None else None
    if resume:
        if diff:
            raise ConfigError(f"{saved}: --resume with a different config ({diff}); "
                              f"use the run's config or start a new run dir")
        return
    if has_run:
        why = f"a run with a different config ({diff})" if diff else "a training run"
        raise ConfigError(f"{run_dir} already holds {why}; pass --resume to continue it, --overwrite "
                          f"to delete it and start over, or choose another --run-dir")


LOCK_NAME = ".tcli-train.lock"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path):
    """Hold an exclusive flock on run_dir/.tcli-train.lock while training, so a second `tcli train` there
    (even with --resume or --overwrite) is refused instead of interleaving checkpoints. The kernel drops
    the lock when the process ends, however it ends (SIGKILL included): no stale lock to clean up."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    # The file stays empty: a command that then fails (a refused --resume, say) must change nothing.
    with open(run_dir / LOCK_NAME, "a", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TcliError(f"{run_dir} is in use by another `tcli train` (it holds {run_dir / LOCK_NAME}; "
                            f"`fuser` names it); wait for it to end or choose another --run-dir") from None
        yield


# ---------------------------------------------------------------- distributed


@dataclass
class Dist:
    """Rank bookkeeping; world 1 when not started by torchrun."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(device_ids=[self.local_rank]) if self.device.type == "cuda" else dist.barrier()

    def max(self, values: list[float]) -> list[float]:
        """Elementwise max over ranks (flags every rank must agree on)."""
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
        return value

    def on_main(self, fn):
        """Run fn on rank 0 only; if it fails, every rank raises (nobody waits forever)."""
        error = None
        if self.main:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below after telling the others
                error = e
        if self.max([1.0 if error else 0.0])[0]:
            if error is not None:
                raise error
            raise TcliError("rank 0 failed; see its error above")


def init_distributed(requested: str) -> Dist:
    """Join the torchrun process group (gloo on CPU, NCCL on CUDA) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(requested)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, world, local_rank, device)


# ---------------------------------------------------------------- helpers


def rng_state() -> dict:
    """Python, numpy and torch RNG states as plain containers (weights_only-loadable)."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put `item` unless `stop` is set first; True when it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def prefetch(items, depth: int = 2):
    """Yield from `items` computed by a background thread `depth` ahead (collation overlaps compute).

    Closing the generator stops and joins the thread: no thread may outlive the loop (a daemon
    thread still inside torch at interpreter exit aborts the process).
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def work():
        try:
            for item in items:
                if not _put(q, item, stop):
                    return
            _put(q, done, stop)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            _put(q, e, stop)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def format_seconds(seconds: float) -> str:
    """'1h02m', '3m05s' or '42s'."""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# ---------------------------------------------------------------- the trainer


class Trainer:
    """Holds the model, optimizer and data of one training run; `run()` trains to a stop condition."""

    def __init__(self, cfg: Config, run_dir: Path, dist: Dist, quiet: bool, resume_command: str,
                 precision: str | None = None):
        from .batching import collate, token_batches
        from .data import load_split
        from .model import build_model
        from .tokenizer import Tokenizer

        self.cfg, self.t, self.run_dir, self.dist, self.quiet = cfg, cfg.train, run_dir, dist, quiet
        self.resume_command = resume_command
        self.device = dist.device
        # train.precision resolved for this device (auto: bf16 or fp32); validation decodes in it too
        self.precision = precision or resolve_precision(self.t.precision, self.device, "train.precision")[0]
        self._collate, self._token_batches = collate, token_batches
        self.train_split, self.valid_split = load_split(run_dir, "train"), load_split(run_dir, "valid")
        self.tokenizer = Tokenizer.load(run_dir / "tokenizer", cfg.data.right_to_left)
        self._epoch_data: tuple[int, object] | None = None  # (epoch, its training split), see epoch_split
        self.bar = self.tb = None
        torch.manual_seed(self.t.seed)  # the same initial weights on every rank
        self.model = build_model(cfg, self.tokenizer.src_vocab_size, self.tokenizer.tgt_vocab_size).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, self.t)
        self.ema = EMA(self.params, self.t.ema_decay) if self.t.ema_decay > 0 else None
        self.updates_per_epoch = self._updates_in(len(self.epoch_batches(1)))
        if self.t.bidirectional_epochs:  # epoch 1 held every pair twice
            self.updates_per_epoch = math.ceil(self.updates_per_epoch / 2)
        self.total_steps = self._total_steps()
        self.scheduler = build_scheduler(self.optimizer, self.t, self.total_steps)
        # a restarted cosine's cycle ends are validated and kept as checkpoints/cycle_K: {step: K}
        self.cycle_ends = ({end: k for k, end in enumerate(cycle_ends(self.total_steps, self.t.cycles), 1)}
                           if self.t.cycles > 1 else {})
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self.progress = Progress()
        self.records: list[dict] = []
        self.signal: int | None = None
        self.last_saved_step: int | None = None
        torch.manual_seed(self.t.seed + 1000 * dist.rank)  # dropout streams differ between ranks

    # -- data

    def epoch_split(self, epoch: int):
        """The training split of this epoch: the prepared one or its sampled segmentation (subword.py), plus
        every pair reversed during the first train.bidirectional_epochs (bidirectional training)."""
        if self._epoch_data is None or self._epoch_data[0] != epoch:
            split = self._sampled_split(epoch) if self.t.subword_alpha else self.train_split
            n = self.t.bidirectional_epochs
            if epoch <= n:
                from .data import with_reversed_pairs

                split = with_reversed_pairs(split)
                if self._epoch_data is None:  # once, when the trainer is set up
                    self.log(f"bidirectional training: epochs 1-{n} train on the pairs and on the pairs reversed")
            elif n and epoch == n + 1:
                self.log(f"bidirectional training: from epoch {epoch} on, source -> target only")
            self._epoch_data = (epoch, split)
        return self._epoch_data[1]

    def _sampled_split(self, epoch: int):
        """This epoch's sampled segmentation: rank 0 draws and saves it; a resumed run finds it saved."""
        from . import subword

        def draw() -> None:
            if not subword.sample_path(self.run_dir, epoch).is_file():
                start = time.perf_counter()
                split = subword.sampled_split(self.train_split, self.tokenizer, self.cfg)
                subword.save_sample(self.run_dir, epoch, split)
                self.log(f"subword sampling: epoch {epoch} resampled in {time.perf_counter() - start:.1f}s, "
                         f"{subword.mean_growth(self.train_split, split):.2f}x the prepared tokens")

        self.dist.on_main(draw)
        self.dist.barrier()
        return subword.load_sample(self.run_dir, epoch, self.train_split)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches (index arrays), cut to a multiple of world so all ranks step together."""
        split = self.epoch_split(epoch)
        batches = self._token_batches(split.src_lens + 1, split.tgt_lens + 1, self.t.max_tokens, self.t.seed, epoch,
                                      shuffle=True)  # + EOS on the source, + BOS/EOS on the target
        batches = batches[: len(batches) - len(batches) % self.dist.world]
        if not batches:
            raise DataError(f"{self.run_dir / 'data'}: the training split gives fewer batches than the "
                            f"{self.dist.world} ranks; use more data or fewer processes")
        return batches

    def _updates_in(self, num_batches: int) -> int:
        return math.ceil(num_batches / (self.dist.world * self.t.update_freq))

    def _total_steps(self) -> int:
        """Planned updates (for cosine and the progress bar): max_steps, else max_epochs x updates/epoch
        (bidirectional epochs count twice)."""
        doubled = min(self.t.bidirectional_epochs, self.t.max_epochs)  # epochs that also hold the reversed pairs
        by_epochs = (self.t.max_epochs + doubled) * self.updates_per_epoch
        if self.t.max_steps and by_epochs:
            return min(self.t.max_steps, by_epochs)
        return self.t.max_steps or by_epochs

    def updates(self, split, batches: list[np.ndarray], start: int):
        """(position after, global target tokens, this rank's collated batches) for each update from `start`."""
        span = self.dist.world * self.t.update_freq
        tgt_lens = split.tgt_lens + 1
        for pos in range(start, len(batches), span):
            chunk = batches[pos: pos + span]
            tokens = int(sum(tgt_lens[idx].sum() for idx in chunk))
            mine = [self._collate(split, idx) for idx in chunk[self.dist.rank:: self.dist.world]]
            yield pos + len(chunk), tokens, mine

    # -- state

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: optimizer, scheduler, scaler, counters, RNG of every rank."""
        rngs = [rng_state()]
        if self.dist.world > 1:
            import torch.distributed as dist

            rngs = [None] * self.dist.world
            dist.all_gather_object(rngs, rng_state())
        return {
            "format": 1,
            "progress": asdict(self.progress),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else {},
            "ema": self.ema.state_dict() if self.ema else None,
            "rng": rngs,
            "world_size": self.dist.world,
            "config_hash": config_hash(self.cfg),  # what tcli before "config" compares on --resume
            "config": identity(self.cfg),
        }

    def restore(self) -> Path:
        """Load checkpoints/last (weights, optimizer, scheduler, scaler, counters, RNG)."""
        folder = ck.resumable(self.run_dir)
        if folder is None:
            raise DataError(f"--resume: {ck.checkpoints_dir(self.run_dir) / 'last'} holds no complete checkpoint "
                            f"(model.safetensors + trainer_state.pt); start without --resume")
        state = ck.load_state(folder)
        diff = checkpoint_difference(state, self.cfg)
        if diff:
            raise ConfigError(f"{folder}: --resume with a config that differs from the checkpoint's ({diff}); "
                              f"use the run's config.yaml")
        ck.load_weights(self.model, folder / ck.WEIGHTS)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        if self.ema and state.get("ema"):
            self.ema.load_state_dict(state["ema"])
        self.progress = Progress(**state["progress"])
        rngs = state["rng"]
        if state["world_size"] == self.dist.world:
            set_rng_state(rngs[self.dist.rank])
        else:  # a different number of ranks: the data split differs anyway, so exactness is moot
            torch.manual_seed(self.t.seed + 1000 * self.dist.rank + self.progress.step)
        self.last_saved_step = self.progress.step
        return folder

    def initialise_from(self, source: str) -> None:
        """Fine-tuning: the weights of train.init_from; optimizer, schedule and counters start afresh."""
        weights, _ = ck.init_source(source)
        try:
            ck.load_weights(self.model, weights)
        except DataError as e:
            raise DataError(f"train.init_from: {e}; its model section must match the config's") from None
        self.log(f"initialised from {weights} (fine-tuning: new optimizer, schedule and step count)")

    # -- one update

    def train_update(self, batches: list, tokens: int, loss_acc: torch.Tensor, model) -> float:
        """Forward/backward over this rank's micro-batches, clip, step; returns the lr it used."""
        scale = self.dist.world / tokens  # DDP averages over ranks: undo it, divide by global tokens
        for i, batch in enumerate(batches):
            batch = batch.to(self.device)
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or self.dist.world == 1 else model.no_sync()
            with sync:
                with autocast(self.device, self.precision):  # logits not kept: frees (B, T, V) early
                    loss = self.batch_loss(model, batch)
                scaled = loss * scale
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_acc += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.t.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.t.clip_norm, foreach=True)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.ema:
            self.ema.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def batch_loss(self, model, batch) -> torch.Tensor:
        """Summed training loss of one micro-batch: smoothed CE, or with R-Drop two passes and their KL."""
        if not self.t.rdrop_alpha:
            return token_loss_sum(model(batch.src, batch.tgt_in), batch.tgt_out, self.t.label_smoothing)
        twice = model(torch.cat([batch.src, batch.src]), torch.cat([batch.tgt_in, batch.tgt_in]))  # (2B, T, V)
        return rdrop_loss_sum(twice, batch.tgt_out, self.t.label_smoothing, self.t.rdrop_alpha)

    # -- validation

    @torch.inference_mode()
    def valid_loss(self) -> float:
        """Plain cross-entropy (no smoothing) per target token on the validation set."""
        split = self.valid_split
        src_lens, tgt_lens = split.src_lens + 1, split.tgt_lens + 1
        batches = self._token_batches(src_lens, tgt_lens, 2 * self.t.max_tokens, self.t.seed, 0, shuffle=False)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for idx in batches:
            batch = self._collate(split, idx).to(self.device)
            with autocast(self.device, self.precision):
                logits = self.model(batch.src, batch.tgt_in)
                total += token_loss_sum(logits.float(), batch.tgt_out).double()
        return total.item() / max(int(tgt_lens.sum()), 1)

    def valid_scores(self) -> dict:
        """BLEU/chrF of the decoded validation set."""
        from .metrics import corpus_scores
        from .search import decode_ids

        srcs = [ids.tolist() for ids in self.valid_split.src]
        # decode in the training precision, best hypothesis only, never sampled
        dcfg = dataclasses.replace(self.cfg.decode, precision=self.precision, sampling=False, nbest=1)
        hyps = decode_ids(self.model, srcs, dcfg, self.device, beam=self.t.valid_beam)
        scores = corpus_scores(self.tokenizer.decode_tgt(hyps), self.valid_split.tgt_text)
        return {"valid_bleu": round(scores["bleu"], 3), "valid_chrf": round(scores["chrf"], 3)}

    def validate(self) -> dict:
        """Valid loss, perplexity, BLEU and chrF; the RNG is restored so training is unaffected."""
        saved = rng_state()
        self.model.eval()
        try:
            loss = self.valid_loss()
            result = {"valid_loss": round(loss, 5), "valid_ppl": round(math.exp(min(loss, 50.0)), 3)}
            result.update(self.valid_scores())
        finally:
            self.model.train()
            set_rng_state(saved)
        return result

    def score(self, result: dict) -> float:
        """The model-selection score: valid_bleu, valid_chrf or valid_loss."""
        return result[f"valid_{self.t.valid_metric}"]

    # -- checkpoints and logs

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def save(self, result: dict | None) -> None:
        """Write step_N (+ best when improved) and last (with trainer state); prune old step_N."""
        root = ck.checkpoints_dir(self.run_dir)
        info = {"step": self.progress.step, "epoch": self.progress.epoch, **(result or {})}
        state = self.state_dict()  # collective under DDP: every rank calls save()
        if self.dist.main:
            if result is not None:
                ck.write_checkpoint(root / ck.step_name(self.progress.step), self.model, info)
                if self.progress.best_step == self.progress.step:
                    ck.write_checkpoint(root / "best", self.model, info)
                if self.progress.step in self.cycle_ends:  # a snapshot: the end of one cosine cycle
                    ck.write_checkpoint(root / f"cycle_{self.cycle_ends[self.progress.step]}", self.model, info)
            if self.ema:  # the moving average as of this step; no validation score of its own
                with self.ema.swapped():
                    ck.write_checkpoint(root / "ema", self.model, {"step": self.progress.step,
                                                                   "epoch": self.progress.epoch,
                                                                   "ema_decay": self.ema.decay})
            ck.write_checkpoint(root / "last", self.model, info, state=state)
            ck.prune(self.run_dir, self.t.keep_last, self.t.keep_best, self.t.valid_metric)
        self.last_saved_step = self.progress.step

    def record(self, entry: dict) -> None:
        """Append one JSON line to metrics.jsonl (rewritten atomically) and to TensorBoard."""
        if not self.dist.main:
            return
        self.records.append(entry)
        text = "".join(json.dumps(r) + "\n" for r in self.records)
        atomic_write_text(self.run_dir / "metrics.jsonl", text)
        if self.tb is not None:
            for key, value in entry.items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, entry["step"])
            self.tb.flush()

    def load_records(self) -> None:
        """Keep the metrics lines up to the resumed step (later ones came from the killed run)."""
        from .plots import read_metrics  # a broken line is a DataError naming it, not a traceback

        path = self.run_dir / "metrics.jsonl"
        if self.dist.main and path.is_file():
            lines = [r for r in read_metrics(self.run_dir) if isinstance(r, dict)]
            self.records = [r for r in lines if r.get("step", 0) <= self.progress.step]

    def log(self, message: str) -> None:
        if self.dist.main and not self.quiet:
            if self.bar is not None:
                self.bar.write(message, file=sys.stderr)
            else:
                print(message, file=sys.stderr, flush=True)

    # -- the loop

    def run(self, resume: bool) -> dict:
        """Train until a stop condition; returns a summary (with `exit_code` 130/143 after a signal)."""
        from .model import Seq2SeqTransformer  # noqa: F401 - model module must import before compile

        if resume:
            folder = self.restore()
            self.log(f"resumed from {folder} at step {self.progress.step}, epoch {self.progress.epoch}, "
                     f"batch {self.progress.position}")
        elif self.t.init_from:
            self.initialise_from(self.t.init_from)
        self.load_records()
        self.tb = _tensorboard(self.run_dir) if self.dist.main else None
        model = self._wrap()
        self.bar = self._progress_bar()
        old_handlers = self._install_signals()
        try:
            reason = self._loop(model)
        finally:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            if self.bar is not None:
                self.bar.close()
            if self.tb is not None:
                self.tb.close()
        return self._summary(reason)

    def _wrap(self):
        """The module the training step calls: optionally compiled, DDP-wrapped under torchrun."""
        model = self.model
        if self.t.compile:
            model = torch.compile(model)
        if self.dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.dist.local_rank] if self.device.type == "cuda" else None
            model = DDP(model, device_ids=ids)
        return model

    def _loop(self, model) -> str:
        """The epoch/update loop; returns why it stopped."""
        p, t = self.progress, self.t
        start = time.perf_counter() - p.wall_s
        loss_acc = torch.zeros((), device=self.device)
        window_tokens, window_start = 0, time.perf_counter()
        self.model.train()
        while True:
            # a resumed run may already be done (e.g. --resume after it finished)
            if t.max_epochs and p.epoch > t.max_epochs:
                return self._finish("max_epochs")
            if t.max_steps and p.step >= t.max_steps:
                return self._finish("max_steps")
            if t.patience and p.bad_validations >= t.patience:
                return "patience"
            split, batches = self.epoch_split(p.epoch), self.epoch_batches(p.epoch)
            if self.bar is not None:
                self.bar.set_description(f"epoch {p.epoch}")
            for position, tokens, mine in prefetch(self.updates(split, batches, p.position)):
                lr = self.train_update(mine, tokens, loss_acc, model)
                p.step, p.position = p.step + 1, position
                p.wall_s = time.perf_counter() - start
                window_tokens += tokens
                if self.bar is not None:
                    self.bar.update(1)
                timeout = bool(t.max_minutes and p.wall_s >= 60 * t.max_minutes)
                check = self.device.type == "cpu" or p.step % t.log_every == 0
                bad = check and not math.isfinite(float(loss_acc))  # free on CPU; else only at log steps
                sig, timeout, bad = self.dist.max([float(self.signal or 0), float(timeout), float(bad)])
                if bad:
                    self._diverged()
                if p.step % t.log_every == 0:
                    rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
                    self._log_train(float(self.dist.sum(loss_acc)) / window_tokens, lr, rate)
                    loss_acc.zero_()
                    window_tokens, window_start = 0, time.perf_counter()
                if sig:
                    self.signal = int(sig)
                    self.save(None)
                    return "signal"
                if (p.step % t.valid_every == 0 or p.step in self.cycle_ends) and self._validate_and_save():
                    return "patience"
                if t.max_steps and p.step >= t.max_steps:
                    return self._finish("max_steps")
                if timeout:
                    return self._finish("max_minutes")
            p.epoch, p.position = p.epoch + 1, 0
            if t.max_epochs and p.epoch > t.max_epochs:
                return self._finish("max_epochs")

    def _finish(self, reason: str) -> str:
        """Validate and save at the end unless the last update was just validated."""
        if self.progress.last_valid_step != self.progress.step:
            self._validate_and_save()
        return reason

    def _validate_and_save(self) -> bool:
        """Validate on rank 0, update early stopping, save; True when patience ran out."""
        p = self.progress
        if not self.weights_finite():
            self._diverged()
        result = None
        if self.dist.main:
            result = self.validate()
            score = self.score(result)
            if ck.better(score, p.best_score, self.t.valid_metric):
                p.best_score, p.best_step, p.bad_validations = score, p.step, 0
            else:
                p.bad_validations += 1
            p.last_valid_step = p.step
            self.record({"step": p.step, "epoch": p.epoch, **result, "wall_s": round(p.wall_s, 1)})
            self._log_valid(result)
        self._share_progress()
        self.save(result if self.dist.main else {})
        return bool(self.t.patience and p.bad_validations >= self.t.patience)

    def _share_progress(self) -> None:
        """Give every rank rank 0's early-stopping counters."""
        if self.dist.world == 1:
            return
        import torch.distributed as dist

        box = [asdict(self.progress)]
        dist.broadcast_object_list(box, src=0)
        for key, value in box[0].items():  # in place: the loop holds a reference to self.progress
            setattr(self.progress, key, value)

    def _diverged(self) -> None:
        p = self.progress
        last = ck.checkpoints_dir(self.run_dir) / "last"
        where = (f"the last good checkpoint is {last} (step {self.last_saved_step})" if self.last_saved_step
                 else "no checkpoint was written")
        raise TcliError(f"training diverged: the loss or weights became NaN/inf at step {p.step} (epoch {p.epoch}); "
                        f"{where}; lower train.lr or raise train.warmup_steps")

    def _log_train(self, loss: float, lr: float, rate: float) -> None:
        p = self.progress
        self.record({"step": p.step, "epoch": p.epoch, "train_loss": round(loss, 5), "lr": lr,
                     "tokens_per_s": round(rate, 1), "wall_s": round(p.wall_s, 1)})
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f} lr {lr:.2e} tok/s {rate:,.0f}", refresh=False)
            return
        total = f"/{self.total_steps}" if self.total_steps else ""
        eta = ""
        if self.total_steps and p.step:
            eta = f" eta {format_seconds(p.wall_s / p.step * (self.total_steps - p.step))}"
        self.log(f"epoch {p.epoch} step {p.step}{total} loss {loss:.4f} lr {lr:.3e} "
                 f"tgt tok/s {rate:,.0f} elapsed {format_seconds(p.wall_s)}{eta}")

    def _log_valid(self, result: dict) -> None:
        p = self.progress
        parts = " ".join(f"{k[6:]} {v}" for k, v in result.items())
        self.log(f"valid step {p.step}: {parts} (best {self.t.valid_metric} {p.best_score} at step {p.best_step})")

    def _progress_bar(self):
        if self.quiet or not self.dist.main or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        bar = tqdm(total=self.total_steps or None, initial=self.progress.step, unit="step", file=sys.stderr,
                   dynamic_ncols=True)
        bar.set_description(f"epoch {self.progress.epoch}")
        return bar

    def _install_signals(self) -> dict:
        """SIGINT/SIGTERM set a flag: the current update finishes, a checkpoint is saved, then exit."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self.signal = signum

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _summary(self, reason: str) -> dict:
        p = self.progress
        out = {
            "run_dir": str(self.run_dir), "stopped": reason, "step": p.step, "epoch": p.epoch,
            "metric": self.t.valid_metric, "best_score": p.best_score, "best_step": p.best_step,
            "wall_s": round(p.wall_s, 1), "precision": self.precision, "exit_code": 0,
        }
        if reason == "signal":
            name = signal.Signals(self.signal).name
            out["exit_code"] = 128 + self.signal
            self.log(f"{name}: saved {ck.checkpoints_dir(self.run_dir) / 'last'} at step {p.step}; "
                     f"resume with: {self.resume_command}")
        return out


def _tensorboard(run_dir: Path):
    """A SummaryWriter when tensorboard is installed, else None (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def check_limits(cfg: Config) -> None:
    """At least one stop condition must be set, and a validation split."""
    t = cfg.train
    if not (t.max_steps or t.max_epochs or t.max_minutes or t.patience):
        raise ConfigError("set at least one of train.max_steps, train.max_epochs, train.max_minutes or "
                          "train.patience, or training never stops")
    if not cfg.data.valid_split:  # prepare skips an empty split name; training validates and keeps the best
        raise ConfigError("data.valid_split is empty, but training validates every train.valid_every updates "
                          "and keeps the best checkpoints by it; name a validation split")


def train(cfg: Config, run_dir: str | Path | None = None, resume: bool = False, overwrite: bool = False,
          quiet: bool = False, resume_command: str = "tcli train --config CONFIG --resume") -> dict:
    """Prepare the data if needed, then train; returns a summary dict (see Trainer._summary)."""
    from .data import adopt_init_tokenizer, prepare

    run_dir = Path(run_dir if run_dir is not None else cfg.run_dir)
    cfg.run_dir = str(run_dir)
    check_limits(cfg)
    adopt_init_tokenizer(cfg, run_dir)  # before the run-dir check: the saved config names the tokenizer used
    dist = init_distributed(cfg.train.device)
    held = contextlib.ExitStack()  # rank 0's run-dir lock, held until training ends
    try:
        precision, note = resolve_precision(cfg.train.precision, dist.device, "train.precision")
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)

        def setup():
            held.enter_context(run_dir_lock(run_dir))
            check_run_dir(cfg, run_dir, resume, overwrite)
            ck.recover(run_dir)
            prepare(cfg, run_dir, quiet=quiet)

        dist.on_main(setup)
        trainer = Trainer(cfg, run_dir, dist, quiet, resume_command, precision)
        if note:
            trainer.log(note)
        return trainer.run(resume)
    finally:
        held.close()
        if dist.world > 1:
            import torch.distributed as tdist

            if tdist.is_initialized():
                tdist.destroy_process_group()
