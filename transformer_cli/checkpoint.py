"""Checkpoints: safetensors weights, trainer state loaded with weights_only, atomic folder switches.

Layout: `run_dir/checkpoints/<name>/` holds `model.safetensors`, `info.json` (step, epoch, valid
scores) and, for `last/` only, `trainer_state.pt` (optimizer, scheduler, RNG, data position).
Names: `last`, `best`, `averaged`, `step_00001000`.

A checkpoint folder is switched atomically: its files are written (each fsynced) into a hidden
temporary folder next to it, the old folder is renamed to `.<name>.old`, the new one renamed into
place, then the old one is removed. A kill between the two renames leaves `.<name>.old`, which
`recover` renames back and `resolve_checkpoint` falls back to, so a complete checkpoint is always
on disk. Weights are never pickled; the trainer state only holds tensors, numbers, strings, lists
and dicts, so `torch.load(weights_only=True)` refuses anything that would run code.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from .errors import DataError, TcliError
from .io_utils import _fsync_dir, atomic_save, atomic_write_text

WEIGHTS = "model.safetensors"
STATE = "trainer_state.pt"
INFO = "info.json"
VOCAB_MATRICES = ("src_embed.weight", "tgt_embed.weight", "output.weight")  # (V, d_model) in model.py


def checkpoints_dir(run_dir: str | Path) -> Path:
    """The folder holding every checkpoint of a run."""
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    """Folder name of the periodic checkpoint taken after `step` updates."""
    return f"step_{step:08d}"


# ---------------------------------------------------------------- writing


def save_weights(model: torch.nn.Module, path: str | Path, metadata: dict | None = None) -> None:
    """Write the model's weights to a safetensors file atomically (tied weights are stored once)."""
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    atomic_save(path, lambda tmp: save_model(model, str(tmp), metadata=meta or None))


def save_state(state: dict, path: str | Path) -> None:
    """Write the trainer state with torch.save atomically (plain containers and tensors only)."""
    atomic_save(path, lambda tmp: torch.save(state, tmp))


def write_checkpoint(folder: str | Path, model: torch.nn.Module, info: dict, state: dict | None = None,
                     fail_before_switch: bool = False) -> Path:
    """Write weights, info (and trainer state) into `folder`, switching the whole folder atomically.

    `fail_before_switch` simulates a crash after every file is written but before the switch (tests).
    """
    folder = Path(folder)
    tmp = _temp_dir(folder)
    try:
        save_weights(model, tmp / WEIGHTS, {"step": info.get("step", "")})
        if state is not None:
            save_state(state, tmp / STATE)
        atomic_write_text(tmp / INFO, json.dumps(info, indent=1, sort_keys=True) + "\n")  # written last
        if fail_before_switch:
            raise OSError("injected failure before the checkpoint switch")
        _switch(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _temp_dir(folder: Path) -> Path:
    """A fresh hidden folder next to `folder` with the usual permissions (mkdtemp makes it 0700)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


def _switch(new: Path, folder: Path) -> None:
    """Move the complete folder `new` to `folder`, keeping the old one until the new one is in place."""
    old = folder.parent / f".{folder.name}.old"
    try:
        if old.exists():  # left over by an earlier crash: `folder` is complete or `old` is the only copy
            if folder.exists():
                shutil.rmtree(old)
            else:
                os.replace(old, folder)
        if folder.exists():
            os.replace(folder, old)
        os.replace(new, folder)
        _fsync_dir(folder.parent)
    except OSError as e:
        raise TcliError(f"cannot write checkpoint {folder}: {e.strerror or e}; the previous one is kept") from None
    shutil.rmtree(old, ignore_errors=True)


def recover(run_dir: str | Path) -> None:
    """Undo what a kill during a checkpoint switch left: put `.X.old` back, drop partial temp folders."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".old") and entry.is_dir():
            target = root / entry.name[1:-4]
            if target.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.replace(entry, target)
        elif entry.name.startswith(".") and entry.name.endswith(".tmp"):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def remove_checkpoint(folder: str | Path) -> None:
    """Delete a checkpoint folder (renamed out of the way first so no half-deleted folder remains)."""
    folder = Path(folder)
    if not folder.exists():
        return
    doomed = folder.parent / f".{folder.name}.del.tmp"
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ---------------------------------------------------------------- reading


def is_checkpoint_name(name: str) -> bool:
    """True for a folder name under checkpoints/ (best, last, averaged, step_N, or `tcli average -o NAME`),
    False for a path (it holds a slash or names a .safetensors file)."""
    return "/" not in name and not name.endswith(".safetensors")


def resolve_checkpoint(run_dir: str | Path, name: str) -> Path:
    """Path of the weights file for `name`: a folder under checkpoints/ (best, last, averaged, step_N,
    any `tcli average -o` name), else a checkpoint folder or .safetensors path."""
    root = checkpoints_dir(run_dir)
    candidates = []
    if is_checkpoint_name(name):
        candidates = [root / name, root / f".{name}.old"]  # .old: a kill hit the folder switch
    candidates.append(Path(name))
    for cand in candidates:
        if cand.is_dir() and (cand / WEIGHTS).is_file():
            return cand / WEIGHTS
        if cand.is_file():
            return cand
    have = ", ".join(sorted(p.name for p in root.iterdir() if not p.name.startswith("."))) if root.is_dir() else ""
    where = f"{root} holds: {have}" if have else f"{root} holds no checkpoints; train first"
    raise DataError(f"checkpoint '{name}' not found ({where}); use a folder name listed there or a path")


def checkpoint_in_run(path: Path) -> tuple[Path, Path] | None:
    """(weights file, run dir) when `path` is a checkpoint folder RUN/checkpoints/NAME or the
    model.safetensors inside one; None otherwise."""
    if path.is_dir() and (path / WEIGHTS).is_file():
        return path / WEIGHTS, path.parent.parent
    if path.is_file() and path.suffix == ".safetensors":
        return path, path.parent.parent.parent
    return None


def init_source(path: str | Path) -> tuple[Path, Path]:
    """(weights file, run dir) of train.init_from: a run dir (its best checkpoint), one of its checkpoint
    folders or a model.safetensors inside one; the run dir must hold the tokenizer the weights need."""
    p = Path(path)
    if p.is_dir() and (p / "config.yaml").is_file():
        weights, run = resolve_checkpoint(p, "best"), p
    elif (inside := checkpoint_in_run(p)) is not None:
        weights, run = inside
    else:
        raise DataError(f"train.init_from: {p} is not a run dir, a checkpoint folder or a .safetensors file")
    if not (run / "tokenizer").is_dir():
        raise DataError(f"train.init_from: {run / 'tokenizer'} not found; fine-tuning needs the tokenizer the "
                        f"weights were trained with, so name a checkpoint inside a run dir")
    return weights, run


def read_info(folder: str | Path) -> dict:
    """The info.json of a checkpoint folder ({} when it has none)."""
    path = Path(folder) / INFO
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable checkpoint info ({e}); delete the folder") from None


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file; anything else (a pickle, a truncated file) is a DataError."""
    path = Path(path)
    if path.is_dir():
        path = path / WEIGHTS
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise DataError(f"{path}: checkpoint file not found") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DataError(
            f"{path}: not a valid safetensors checkpoint ({str(e).splitlines()[0]}); tcli never loads "
            f"pickled weights, re-export or pick another checkpoint"
        ) from None


def load_weights(model: torch.nn.Module, path: str | Path) -> dict:
    """Load a safetensors file (or checkpoint folder) into `model`; returns the file's tensors.

    Tied parameters may be stored under any one of their names. A shape mismatch, a missing or an
    unexpected tensor is a DataError naming the tensor (and both shapes).
    """
    tensors = load_tensors(path)
    own = model.state_dict()
    for key in sorted(tensors, key=lambda k: k not in VOCAB_MATRICES):  # these name both sizes
        value = tensors[key]
        if key in own and tuple(own[key].shape) != tuple(value.shape):
            sizes = ""
            if key in VOCAB_MATRICES and value.dim() == own[key].dim() == 2:
                sizes = (f" (vocabulary {value.shape[0]} and d_model {value.shape[1]} in the checkpoint, "
                         f"{own[key].shape[0]} and {own[key].shape[1]} from the config and tokenizer)")
            raise DataError(
                f"{path}: tensor '{key}' has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(own[key].shape)} in the model{sizes}; the config does not match this checkpoint"
            )
    unexpected = [k for k in tensors if k not in own]
    if unexpected:
        raise DataError(f"{path}: unexpected tensor '{unexpected[0]}' (the model has no such weight); "
                        f"the config does not match this checkpoint")
    loaded_ptrs = {own[k].data_ptr() for k in tensors}
    missing = [k for k in own if k not in tensors and own[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise DataError(f"{path}: tensor '{missing[0]}' is missing from the checkpoint; "
                        f"the config does not match this checkpoint")
    with torch.no_grad():
        for key, value in tensors.items():
            own[key].copy_(value)
    return tensors


def load_state(folder: str | Path) -> dict:
    """Read trainer_state.pt with weights_only=True: a pickle that would run code is refused."""
    path = Path(folder) / STATE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"{path}: trainer state not found; this checkpoint cannot be resumed") from None
    except pickle.UnpicklingError as e:
        raise DataError(
            f"{path}: refused to load, the file holds objects that are not plain tensors or "
            f"containers ({str(e).splitlines()[0][:120]})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise DataError(f"{path}: corrupt trainer state ({str(e).splitlines()[0][:120]})") from None


def resumable(run_dir: str | Path) -> Path | None:
    """The `last/` folder when it holds a complete checkpoint (weights, state, info), else None."""
    folder = checkpoints_dir(run_dir) / "last"
    for cand in (folder, folder.parent / ".last.old"):
        if all((cand / f).is_file() for f in (WEIGHTS, STATE, INFO)):
            return cand
    return None


# ---------------------------------------------------------------- selection and averaging


def better(a: float, b: float | None, metric: str) -> bool:
    """True when score `a` beats `b` (None = no score yet); loss is lower-better, bleu/chrf higher."""
    if b is None:
        return True
    return a < b if metric == "loss" else a > b


def step_checkpoints(run_dir: str | Path) -> list[tuple[int, Path, dict]]:
    """Periodic checkpoints as (step, folder, info), oldest first."""
    root = checkpoints_dir(run_dir)
    out = []
    if root.is_dir():
        for folder in root.glob("step_*"):
            if folder.is_dir() and (folder / WEIGHTS).is_file() and folder.name[5:].isdigit():
                out.append((int(folder.name[5:]), folder, read_info(folder)))
    return sorted(out, key=lambda x: x[0])


def _score(info: dict, metric: str) -> float | None:
    value = info.get(f"valid_{metric}")
    return float(value) if isinstance(value, (int, float)) else None


def ranked_best(run_dir: str | Path, metric: str) -> list[tuple[int, Path, dict]]:
    """Periodic checkpoints with a score for `metric`, best first (ties: the earlier step first)."""
    scored = [c for c in step_checkpoints(run_dir) if _score(c[2], metric) is not None]
    sign = 1.0 if metric == "loss" else -1.0
    return sorted(scored, key=lambda c: (sign * _score(c[2], metric), c[0]))


def prune(run_dir: str | Path, keep_last: int, keep_best: int, metric: str) -> None:
    """Delete periodic checkpoints that are neither among the last `keep_last` nor the best `keep_best`."""
    all_steps = step_checkpoints(run_dir)
    keep = {c[0] for c in all_steps[-keep_last:]} if keep_last > 0 else set()
    keep |= {c[0] for c in ranked_best(run_dir, metric)[:keep_best]}
    for step, folder, _ in all_steps:
        if step not in keep:
            remove_checkpoint(folder)


def average(run_dir: str | Path, last: int = 0, best: int = 0, metric: str = "bleu",
            name: str = "averaged") -> tuple[Path, list[Path]]:
    """Average the weights of the last N or best N periodic checkpoints into `checkpoints/<name>/`."""
    if (last > 0) == (best > 0):
        raise DataError("average: give exactly one of --last N or --best N (N > 0)")
    pool = step_checkpoints(run_dir)[-last:] if last else ranked_best(run_dir, metric)[:best]
    wanted = last or best
    if len(pool) < wanted:
        raise DataError(
            f"average: {checkpoints_dir(run_dir)} holds {len(pool)} usable step_* checkpoints, "
            f"{wanted} were asked for (raise train.keep_last/keep_best or ask for fewer)"
        )
    folders = [c[1] for c in pool]
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for folder in folders:
        tensors = load_tensors(folder)
        if total and set(tensors) != set(total):
            raise DataError(f"{folder}: its tensors differ from {folders[0]}; cannot average different models")
        for key, value in tensors.items():
            if key in total and total[key].shape != value.shape:
                raise DataError(f"{folder}: tensor '{key}' has shape {tuple(value.shape)}, "
                                f"not {tuple(total[key].shape)}; cannot average different models")
            total[key] = total[key] + value.double() if key in total else value.double()  # fp64 sum
            dtypes[key] = value.dtype
    averaged = {k: (v / len(folders)).to(dtypes[k]).contiguous() for k, v in total.items()}
    out = checkpoints_dir(run_dir) / name
    tmp = _temp_dir(out)
    try:
        atomic_save(tmp / WEIGHTS, lambda p: save_file(averaged, str(p), metadata={"averaged": ",".join(f.name for f in folders)}))
        info = {"averaged": [f.name for f in folders], "step": max(c[0] for c in pool)}
        atomic_write_text(tmp / INFO, json.dumps(info, indent=1) + "\n")
        _switch(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, folders
