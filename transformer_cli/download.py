"""Fetch the official Multi30k task-1 raw files, check their sha256 sums, write them atomically."""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from .errors import DataError, TcliError
from .io_utils import atomic_path

# The multi30k/dataset repository, data/task1/raw/ (files as published there).
# TCLI_MULTI30K_URL points at a mirror (any URL urllib reads, file:// included).
MULTI30K_URL = os.environ.get(
    "TCLI_MULTI30K_URL", "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
)
MULTI30K_SHA256 = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
}
DATASETS = {"multi30k": (MULTI30K_URL, MULTI30K_SHA256)}


def is_multi30k_file(name: str) -> bool:
    """True for the file names `tcli download multi30k` can fetch."""
    return name in MULTI30K_SHA256


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, dest: Path, sha256: str, quiet: bool = False, timeout: float = 30.0) -> None:
    """Download `url` to `dest` through a temporary file; a checksum mismatch leaves nothing at `dest`."""
    from tqdm import tqdm

    try:  # connect first: an unreachable server creates no folder and no file
        response = urllib.request.urlopen(url, timeout=timeout)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise TcliError(f"cannot download {url}: {getattr(e, 'reason', None) or e}") from None
    h = hashlib.sha256()
    with response, atomic_path(dest) as tmp:
        size = response.headers.get("Content-Length")
        try:
            with open(tmp, "wb") as out, tqdm(total=int(size) if size else None, unit="B", unit_scale=True,
                                               desc=dest.name, file=sys.stderr, disable=quiet, leave=False) as bar:
                for block in iter(lambda: response.read(1 << 16), b""):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block))
        except OSError as e:
            raise TcliError(f"cannot download {url}: {e}") from None
        if h.hexdigest() != sha256:
            # Raising inside atomic_path removes the temporary file: nothing lands under `dest`.
            raise TcliError(
                f"{url}: sha256 {h.hexdigest()[:12]}... does not match the expected {sha256[:12]}...; "
                f"the download is corrupt, nothing was written to {dest}"
            )


def download_dataset(name: str, dest: str | Path, base_url: str | None = None, files: list[str] | None = None,
                     quiet: bool = False) -> list[Path]:
    """Fetch the files of a known data set into `dest`, skipping those already there with the right sum."""
    if name not in DATASETS:
        raise DataError(f"unknown data set '{name}'; known: {', '.join(DATASETS)}")
    url, sums = DATASETS[name]
    base = (base_url or url).rstrip("/") + "/"
    dest = Path(dest)
    done = []
    for file in files or list(sums):
        target = dest / file
        if target.is_file() and sha256_file(target) == sums[file]:
            if not quiet:
                print(f"download: {target} is already there (sha256 ok)", file=sys.stderr)
        else:
            fetch(base + file, target, sums[file], quiet)
            if not quiet:
                print(f"download: {target} ok", file=sys.stderr)
        done.append(target)
    return done


def fetch_for_prepare(folder: Path, files: list[str], quiet: bool) -> None:
    """Download missing Multi30k files for `tcli prepare`; without network, say where the files go."""
    if not quiet:
        print(f"prepare: {', '.join(files)} missing in {folder}: downloading Multi30k", file=sys.stderr)
    try:
        download_dataset("multi30k", folder, files=files, quiet=quiet)
    except TcliError as e:
        raise DataError(
            f"{folder / files[0]}: file not found and the download failed ({e}); put the Multi30k task-1 "
            f"files ({', '.join(files)}) in {folder} or run `tcli download multi30k --dest {folder}`"
        ) from None

