"""Atomic file writes: a killed or failed write never leaves a half-written file under the final name."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Callable, Iterator

from .errors import TcliError


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path in the same folder; on success fsync it and rename it over `path`."""
    path = Path(path)
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # mkdir would only say "File exists"
        raise TcliError(f"cannot write {path}: {blocker} is a file, not a folder")
    # Named before it exists (not mkstemp): a signal at any moment after this line cannot leave an
    # orphan, since `finally` knows the name. O_EXCL as mkstemp; mode 0666 & ~umask, not mkstemp's 0600.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except OSError as e:
            raise TcliError(f"cannot write {path}: {e.strerror or e}") from None
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        raise TcliError(f"cannot write {path}: {e.strerror or e}; the previous file is unchanged") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write bytes to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 text to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


# How savers that do their own file I/O (safetensors in Rust, torch's zip writer in C++) report a
# failed write (disk full, file too large) instead of raising OSError.
_SAVER_IO_ERRORS = ("I/O error: ", "file write failed", "inline_container.cc", "PytorchStreamWriter")


def atomic_save(path: str | Path, save: Callable[[Path], None]) -> None:
    """Call `save(tmp_path)` (e.g. safetensors.torch.save_file) and move the result to `path` atomically."""
    with atomic_path(path) as tmp:
        try:
            save(tmp)
        except (OSError, TcliError):
            raise
        except Exception as e:  # noqa: BLE001 - only write failures are turned into OSError
            text = str(e).splitlines()[0] if str(e) else ""
            hint = next((h for h in _SAVER_IO_ERRORS if h in text), None)
            if hint is None:
                raise
            reason = text.split(hint, 1)[1] if hint == "I/O error: " else "the write failed (disk full?)"
            raise OSError(reason.split(" (os error")[0]) from e
