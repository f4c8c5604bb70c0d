"""Parallel data: read a split (text/TSV/JSONL files or a `datasets` hub data set), clean the training
pairs, train the tokenizer, encode, and cache everything in the run directory.

Layout written by `prepare`:
  run_dir/tokenizer/   sentencepiece model(s) + tokenizer.json (special ids, settings, cache key)
  run_dir/data/        {train,valid,test}.npz (flat int32 ids + int64 offsets per side),
                       {split}.text.json (the raw lines kept), meta.json (cache key + summary)
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from .config import Config, DataConfig, TokenizerConfig, save_config, validate
from .download import sha256_file
from .errors import DataError
from .io_utils import atomic_path, atomic_write_text

SPLITS = ("train", "valid", "test")
CACHE_VERSION = 1  # bump when the files written here change meaning
# Data keys that change neither the tokenizer nor the encoded splits.
_NOT_IN_KEY = {"num_proc", "download"}
# Data keys that change the encoded splits but not the tokenizer's training text.
_NOT_IN_TOKENIZER_KEY = _NOT_IN_KEY | {"max_len", "max_ratio", "valid_split", "test_split", "target_order"}


# ----------------------------------------------------------------------------- encoded splits
class Ragged(Sequence):
    """A list of int32 arrays stored as one flat array plus offsets (no per-sentence objects)."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]]) -> "Ragged":
        lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=int(offsets[-1]))
        return cls(flat, offsets)

    @classmethod
    def concat(cls, parts: list["Ragged"]) -> "Ragged":
        if not parts:
            return cls(np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64))
        lengths = np.concatenate([p.lengths for p in parts])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(np.concatenate([p.flat for p in parts]), offsets)

    @cached_property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    def select(self, index: np.ndarray) -> "Ragged":
        """The rows at `index`, as a new Ragged."""
        lens = self.lengths[index]
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        # Position of every kept token in the old flat array, without a Python loop over tokens.
        starts = np.repeat(self.offsets[:-1][index] - offsets[:-1], lens)
        return Ragged(self.flat[starts + np.arange(offsets[-1])], offsets)


@dataclass
class EncodedSplit:
    """One prepared split: bare subword ids (no specials) and the raw text lines they came from."""

    src: Ragged
    tgt: Ragged
    text_path: Path | None = None
    _text: dict | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.src)

    @property
    def src_lens(self) -> np.ndarray:
        """Bare source lengths (add 1 for EOS)."""
        return self.src.lengths

    @property
    def tgt_lens(self) -> np.ndarray:
        """Bare target lengths (add 1 for BOS or EOS)."""
        return self.tgt.lengths

    @cached_property
    def _texts(self) -> dict:
        # Loaded on first use: training never needs the training text.
        if self._text is not None:
            return self._text
        try:
            return json.loads(Path(self.text_path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"{self.text_path}: cannot read the split's text ({e}); rerun `tcli prepare`") from None

    @property
    def src_text(self) -> list[str]:
        return self._texts["src"]

    @property
    def tgt_text(self) -> list[str]:
        return self._texts["tgt"]


def with_reversed_pairs(split: EncodedSplit) -> EncodedSplit:
    """The split followed by every pair reversed (target -> source): bidirectional training's data (joint ids only)."""
    return EncodedSplit(Ragged.concat([split.src, split.tgt]), Ragged.concat([split.tgt, split.src]))  # no text


def load_split(run_dir: str | Path, name: str) -> EncodedSplit:
    """Load a split `tcli prepare` encoded: name is train, valid or test."""
    if name not in SPLITS:
        raise ValueError(f"split name must be one of {SPLITS}, got {name!r}")
    path = Path(run_dir) / "data" / f"{name}.npz"
    if not path.is_file():
        raise DataError(f"{path}: the {name} split is not prepared; run `tcli prepare` with this run dir")
    try:
        src, tgt = read_ids(path)
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path}: cannot read the encoded split ({e}); rerun `tcli prepare`") from None
    return EncodedSplit(src, tgt, path.with_suffix(".text.json"))


def read_ids(path: Path) -> tuple[Ragged, Ragged]:
    """The source and target ids of an .npz that `write_ids` wrote (OSError/ValueError/KeyError if it is not one)."""
    with np.load(path) as z:
        return Ragged(z["src_ids"], z["src_offsets"]), Ragged(z["tgt_ids"], z["tgt_offsets"])


def write_ids(path: Path, src: Ragged, tgt: Ragged) -> None:
    """Write source and target ids as one .npz, atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, src_ids=src.flat, src_offsets=src.offsets, tgt_ids=tgt.flat, tgt_offsets=tgt.offsets)


def _save_split(folder: Path, name: str, src: Ragged, tgt: Ragged, src_text: list, tgt_text: list) -> None:
    write_ids(folder / f"{name}.npz", src, tgt)
    atomic_write_text(folder / f"{name}.text.json", json.dumps({"src": src_text, "tgt": tgt_text}, ensure_ascii=False))


# ----------------------------------------------------------------------------- reading sources
def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if path.suffix == ".gz" else raw
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot read the file ({e})") from None


def _decode_utf8(path: Path, raw: bytes) -> str:
    """Decode a whole file, naming the first bad line when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: line {line} is not valid UTF-8 (byte {e.start}); convert the file to UTF-8") from None


def read_lines(path: Path) -> list[str]:
    """All lines of a plain or .gz UTF-8 file, empty ones included (only '\\n' ends a line)."""
    text = _decode_utf8(path, _read_bytes(path))
    lines = text.split("\n")  # not splitlines(): U+2028 or \x0c inside a sentence must not split it
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def source_files(d: DataConfig, split: str, quiet: bool = True, extra_src: Sequence[str] = ()) -> list[Path]:
    """The local files holding one split (downloading Multi30k when allowed); [] for a hub data set.

    Text format: source, target, then one file per language of `extra_src` (data.extra_src_langs)."""
    folder = Path(d.path)
    if d.format == "hub":
        return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")) if folder.is_dir() else []
    langs = [d.src_lang, d.tgt_lang, *extra_src]
    stems = [f"{split}.{lang}" for lang in langs] if d.format == "text" else [f"{split}.{d.format}"]
    found = [_find(folder, s) for s in stems]
    missing = [s for s, p in zip(stems, found) if p is None]
    if missing and d.format == "text" and d.download:
        from . import download

        if all(download.is_multi30k_file(s + ".gz") for s in missing):
            download.fetch_for_prepare(folder, [s + ".gz" for s in missing], quiet)
            found = [_find(folder, s) for s in stems]
            missing = [s for s, p in zip(stems, found) if p is None]
    if missing:
        key = {d.train_split: "train_split", d.valid_split: "valid_split", d.test_split: "test_split"}[split]
        raise DataError(
            f"{folder / missing[0]}: file not found (also tried .gz); check data.path and data.{key}, "
            f"or put the {d.format} files there"
        )
    return found


def _columns(d: DataConfig) -> tuple[str, str]:
    if d.translation_field:
        return f"{d.translation_field}.{d.src_lang}", f"{d.translation_field}.{d.tgt_lang}"
    return d.src_field or d.src_lang, d.tgt_field or d.tgt_lang


def _datasets(quiet: bool, local: bool):
    """Import `datasets` configured for us: offline for local sources, progress bars only when not quiet."""
    if local:  # read by datasets at import time; keeps a local load from trying the network
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # its errors become DataErrors
    if quiet:  # huggingface_hub logs its network retries
        import huggingface_hub

        huggingface_hub.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars() if quiet else datasets.enable_progress_bars()
    return datasets


def _pairs_from_dataset(ds, d: DataConfig, where: str) -> tuple[list[str], list[str]]:
    """Pull the source/target columns out of a `datasets.Dataset` as two lists of strings."""
    src_col, tgt_col = _columns(d)
    if d.translation_field:
        if d.translation_field not in ds.column_names:
            raise DataError(f"{where}: no column '{d.translation_field}' (data.translation_field); columns are {', '.join(ds.column_names)}")
        ds = ds.flatten()  # translation: {de: .., en: ..} -> columns translation.de, translation.en
    out = []
    for col, key in ((src_col, "src_field"), (tgt_col, "tgt_field")):
        if col not in ds.column_names:
            raise DataError(
                f"{where}: no column '{col}' (set data.{key} or data.translation_field); columns are {', '.join(ds.column_names)}"
            )
        values = ds.data.column(col).to_pylist()
        bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
        if bad is not None:
            raise DataError(f"{where}: column '{col}' holds {type(bad).__name__} values, not text")
        out.append(["" if v is None else v for v in values])
    return out[0], out[1]


def _from_data_library(e: Exception) -> bool:
    """True for errors raised by datasets or the libraries under it (bad input, not a tcli bug)."""
    libraries = ("datasets", "huggingface_hub", "fsspec", "requests", "pandas", "pyarrow", "json")
    return any(type(x).__module__.split(".")[0] in libraries for x in (e, e.__cause__) if x is not None)


def _first_bad_json_line(path: Path, d: DataConfig) -> str:
    """Say which line of a JSON Lines file `datasets` could not load, and why."""
    outer = d.translation_field or None
    for number, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            return f"line {number} is not valid JSON ({e})"
        if not isinstance(row, dict):
            return f"line {number} is not a JSON object"
        values = row.get(outer) if outer else row
        if outer and not isinstance(values, dict):
            return f"line {number}: '{outer}' is not an object"
        for lang, key in ((d.src_lang, d.src_field), (d.tgt_lang, d.tgt_field)):
            name = lang if outer else key or lang
            if values.get(name) is not None and not isinstance(values.get(name), str):
                return f"line {number}: '{name}' is {type(values[name]).__name__}, not text"
    return "not valid JSON Lines"


def _check_tsv(path: Path, text: str) -> list[str]:
    """The header's column names; every other line has as many fields, or is blank (an empty pair)."""
    lines = text.split("\n")
    columns = lines[0].rstrip("\r").split("\t")
    for number, line in enumerate(lines[1:], 2):
        if line.rstrip("\r") and line.count("\t") != len(columns) - 1:
            raise DataError(
                f"{path}: line {number} has {line.count(chr(9)) + 1} tab-separated fields, the header has "
                f"{len(columns)} ({', '.join(columns)})"
            )
    return columns


def read_pairs(d: DataConfig, split: str, quiet: bool = True, extra_src: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """Source and target lines of one split (a file stem or hub split name), in file order.

    Each language of `extra_src` adds its lines as more sources of the same target lines, after
    the main pairs (many-to-one training on multi-way data such as Multi30k's de/en/fr)."""
    files = source_files(d, split, quiet, extra_src)
    if d.format == "text":
        tgt, sources = read_lines(files[1]), [files[0], *files[2:]]
        src: list[str] = []
        for path in sources:
            lines = read_lines(path)
            if len(lines) != len(tgt):
                raise DataError(
                    f"{path} has {len(lines)} lines but {files[1]} has {len(tgt)} lines; parallel files must align line by line"
                )
            src += lines
        return src, tgt * len(sources)
    if d.format == "hub":
        return _read_hub(d, split, quiet, local=Path(d.path).is_dir())
    path = files[0]
    text = _decode_utf8(path, _read_bytes(path))  # datasets would not name the line
    columns = _check_tsv(path, text) if d.format == "tsv" else []
    ds_lib = _datasets(quiet, local=True)
    try:
        if d.format == "tsv":
            features = ds_lib.Features({c: ds_lib.Value("string") for c in columns})
            ds = ds_lib.load_dataset(
                "csv", data_files=str(path), split="train", delimiter="\t", quoting=3, features=features,
                na_filter=False, keep_default_na=False, skip_blank_lines=False,  # "NA" is a sentence
            )
        else:
            # on_mixed_types=None: a column mixing text and numbers is an error, not JSON-encoded text
            ds = ds_lib.load_dataset("json", data_files=str(path), split="train", on_mixed_types=None)
    except Exception as e:  # datasets wraps parser errors in its own types
        if not _from_data_library(e):
            raise
        cause = e.__cause__ or e
        if d.format == "jsonl":
            raise DataError(f"{path}: {_first_bad_json_line(path, d)}") from None
        raise DataError(f"{path}: cannot parse the TSV file ({str(cause).splitlines()[0]}); it needs a header row and one tab per line") from None
    return _pairs_from_dataset(ds, d, str(path))


def _read_hub(d: DataConfig, split: str, quiet: bool, local: bool) -> tuple[list[str], list[str]]:
    """Load one split of a hub data set (or a local folder shaped like one) with `datasets.load_dataset`."""
    ds_lib = _datasets(quiet, local)
    where = f"data.path '{d.path}'" + (f" (config '{d.hub_config}')" if d.hub_config else "")
    try:
        ds = ds_lib.load_dataset(d.path, d.hub_config or None, split=split)
    except ValueError as e:
        if "split" in str(e).lower():
            raise DataError(f"{where}: no split '{split}' ({str(e).splitlines()[0]}); set data.*_split") from None
        raise DataError(f"{where}: cannot load the data set ({str(e).splitlines()[0]})") from None
    except (ConnectionError, OSError, FileNotFoundError) as e:
        raise DataError(
            f"{where}: cannot load the data set ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "check the name and network, or point data.path at a local copy"
        ) from None
    except Exception as e:  # datasets has many error types (DatasetNotFoundError, ...): report, no traceback
        if not _from_data_library(e):
            raise
        raise DataError(f"{where}: cannot load the data set ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return _pairs_from_dataset(ds, d, f"{where} split '{split}'")


# ----------------------------------------------------------------------------- cleaning
def normalize(text: str) -> str:
    """Collapse every run of whitespace to one space and strip the ends."""
    return " ".join(text.split())


def clean_text_pairs(d: DataConfig, src: list[str], tgt: list[str]) -> tuple[np.ndarray, dict]:
    """Indices of the training pairs kept by the text filters (empty, dedup), and the counts dropped."""
    keep, seen, counts = [], set(), {"empty": 0, "duplicate": 0}
    for i, (s, t) in enumerate(zip(src, tgt)):
        if not s or not t:
            counts["empty"] += 1
        elif d.dedup and (s, t) in seen:
            counts["duplicate"] += 1
        else:
            keep.append(i)
            if d.dedup:
                seen.add((s, t))
    return np.asarray(keep, dtype=np.int64), counts


def length_filter(d: DataConfig, src_lens: np.ndarray, tgt_lens: np.ndarray) -> tuple[np.ndarray, dict]:
    """Boolean mask of the training pairs within data.max_len and data.max_ratio, and the counts dropped."""
    too_long = (src_lens > d.max_len) | (tgt_lens > d.max_len)
    counts = {"too_long": int(too_long.sum()), "ratio": 0}
    ok = ~too_long
    if d.max_ratio > 0:
        lo, hi = np.minimum(src_lens, tgt_lens), np.maximum(src_lens, tgt_lens)
        bad_ratio = ok & (hi > d.max_ratio * np.maximum(lo, 1))
        counts["ratio"] = int(bad_ratio.sum())
        ok &= ~bad_ratio
    return ok, counts


# ----------------------------------------------------------------------------- cache keys
def fingerprint_files(files: list[Path], known: dict) -> dict:
    """{path: {size, mtime_ns, sha256}}; the sha is reused from `known` while size and mtime match.

    The key depends on the content (a `touch` or a copy does not rebuild), but the content is
    only read again when the file's size or modification time changed.
    """
    out = {}
    for path in files:
        st = path.stat()
        old = known.get(str(path), {})
        same = old.get("size") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns
        out[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                          "sha256": old["sha256"] if same and "sha256" in old else sha256_file(path)}
    return out


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- prepare
def split_stems(d: DataConfig) -> dict:
    """{train/valid/test: file stem or hub split}; an empty valid/test name means no such split."""
    stems = {"train": d.train_split, "valid": d.valid_split, "test": d.test_split}
    return {name: stem for name, stem in stems.items() if stem}


def _read_meta(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _read_splits(d: DataConfig, stems: dict, files: dict, quiet: bool) -> dict:
    """{split: (raw source lines, raw target lines)}, with data.max_train_pairs applied."""
    raw = {}
    for name, stem in stems.items():
        src, tgt = read_pairs(d, stem, quiet, d.extra_src_langs if name == "train" else ())
        if name == "train" and d.max_train_pairs:  # the first N lines of each source language
            per = len(src) // (1 + len(d.extra_src_langs))
            rows = [b * per + i for b in range(1 + len(d.extra_src_langs)) for i in range(min(per, d.max_train_pairs))]
            src, tgt = [src[i] for i in rows], [tgt[i] for i in rows]
        if not src:
            raise DataError(f"{', '.join(map(str, files[name])) or d.path}: the {name} split ('{stem}') is empty")
        raw[name] = (src, tgt)
    _log(f"prepare: read {', '.join(f'{n} {len(p[0])}' for n, p in raw.items())} pairs from {d.path}", quiet)
    return raw


def _encode(tokenizer, d: DataConfig, src_text: list[str], tgt_text: list[str], chunk: int = 1 << 16) -> tuple[Ragged, Ragged]:
    """Encode both sides in chunks, so a large corpus never exists as one list of Python ints."""
    def side(encode, texts):
        return Ragged.concat([Ragged.from_lists(encode(texts[i:i + chunk], num_threads=d.num_proc))
                              for i in range(0, len(texts), chunk)])

    return side(tokenizer.encode_src, src_text), side(tokenizer.encode_tgt, tgt_text)


def adopt_init_tokenizer(cfg: Config, run_dir: Path | None = None) -> Path | None:
    """Fine-tuning (train.init_from): the tokenizer folder of the run the weights come from, whose settings
    replace cfg.tokenizer so the run's saved config says what it uses; None without train.init_from.
    Once run_dir holds its copy, that copy stands in when the source run is gone (a later --resume)."""
    if not cfg.train.init_from:
        return None
    from .checkpoint import init_source
    from .tokenizer import META_FILE

    try:
        folder = init_source(cfg.train.init_from)[1] / "tokenizer"
    except DataError:
        copy = Path(run_dir or ".") / "tokenizer"
        if run_dir is None or _read_meta(copy / META_FILE).get("init_from") != cfg.train.init_from:
            raise
        folder = copy
    meta = _read_meta(folder / META_FILE)
    if not isinstance(meta.get("settings"), dict):
        raise DataError(f"train.init_from: {folder / META_FILE} is missing or unreadable; that run was never prepared")
    known = {k: v for k, v in meta["settings"].items() if k in TokenizerConfig.__dataclass_fields__}
    cfg.tokenizer = replace(cfg.tokenizer, **known)
    validate(cfg, f"{folder / META_FILE} (train.init_from)")
    return folder


def prepare(cfg: Config, run_dir: str | Path, quiet: bool = False) -> dict:
    """Read, clean, tokenize and encode every split into run_dir (or reuse the cache); returns a summary."""
    from .tokenizer import META_FILE, Tokenizer, copy_tokenizer, model_files, train_tokenizer

    start = time.perf_counter()
    d = cfg.data
    run_dir = Path(run_dir)
    data_dir, tok_dir = run_dir / "data", run_dir / "tokenizer"
    init_tok = adopt_init_tokenizer(cfg, run_dir)
    save_config(cfg, run_dir / "config.yaml")
    stems = split_stems(d)
    if "train" not in stems:
        raise DataError("key 'data.train_split' is empty; name the training split")

    # Cache keys: settings + content hashes of the data files (re-hashed only when size/mtime moved).
    meta = _read_meta(data_dir / "meta.json")
    files = {name: source_files(d, stem, quiet, d.extra_src_langs if name == "train" else ()) for name, stem in stems.items()}
    prints = {name: fingerprint_files(fs, meta.get("files", {})) for name, fs in files.items()}
    sha = {name: [f["sha256"] for f in p.values()] for name, p in prints.items()}
    settings = {k: v for k, v in asdict(d).items() if k not in _NOT_IN_KEY}
    if not d.right_to_left:  # the default order leaves the caches of runs prepared before the key valid
        del settings["target_order"]
    tok_settings = {k: v for k, v in settings.items() if k not in _NOT_IN_TOKENIZER_KEY}
    tok_key = _key(CACHE_VERSION, tok_settings, asdict(cfg.tokenizer), sha["train"])
    data_key = _key(CACHE_VERSION, settings, asdict(cfg.tokenizer), sha)
    if init_tok is not None:  # fine-tuning: the key is the copied subword models' content
        tok_key = _key(CACHE_VERSION, "copied", [sha256_file(p) for p in model_files(init_tok)])
        data_key = _key(data_key, tok_key)
    all_prints = {k: v for p in prints.values() for k, v in p.items()}
    outputs = [data_dir / f"{name}{ext}" for name in stems for ext in (".npz", ".text.json")]
    if meta.get("key") == data_key and all(p.is_file() for p in outputs) and (tok_dir / META_FILE).is_file():
        if meta.get("files") != all_prints:  # same contents, new stat: remember it to skip hashing next time
            atomic_write_text(data_dir / "meta.json", json.dumps({**meta, "files": all_prints}, indent=1))
        _log(f"prepare: {run_dir} is up to date (same data files and settings); nothing to do", quiet)
        return {**meta["summary"], "cached": True, "seconds": round(time.perf_counter() - start, 3)}
    # From here on the old cache is invalid: a crash must not leave its key next to new files.
    (data_dir / "meta.json").unlink(missing_ok=True)

    raw = _read_splits(d, stems, files, quiet)
    norm = (lambda xs: [normalize(x) for x in xs]) if d.normalize_whitespace else list
    texts = {name: (norm(s), norm(t)) for name, (s, t) in raw.items()}
    keep, counts = clean_text_pairs(d, *texts["train"])
    if not len(keep):
        raise DataError(f"{d.path}: no training pairs left after dropping empty lines")
    texts["train"] = ([texts["train"][0][i] for i in keep], [texts["train"][1][i] for i in keep])

    own_copy = init_tok is not None and init_tok.resolve() == tok_dir.resolve()  # the source run is gone
    if _read_meta(tok_dir / META_FILE).get("cache_key") == tok_key or own_copy:  # same training text or copy
        tokenizer, tok_state = Tokenizer.load(tok_dir), "reused"
    elif init_tok is not None:
        tokenizer = copy_tokenizer(init_tok, tok_dir, {"cache_key": tok_key, "init_from": cfg.train.init_from})
        tok_state = f"copied from {init_tok}"
        _log(f"prepare: fine-tuning, so the tokenizer is {init_tok}'s (train.init_from)", quiet)
    else:
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(cfg.tokenizer, *texts["train"], tok_dir, verbose=os.environ.get("TCLI_DEBUG") == "1",
                                    extra_meta={"cache_key": tok_key})
        tok_state = "trained"
        _log(f"prepare: trained a {'joint' if tokenizer.joint else 'source/target'} {cfg.tokenizer.model_type} "
             f"tokenizer in {time.perf_counter() - t0:.1f}s", quiet)

    tokenizer = tokenizer.oriented(d.right_to_left)  # r2l: the encoded targets run back to front
    summary_splits = {}
    for name in stems:
        src, tgt = _encode(tokenizer, d, *texts[name])
        raw_index = keep if name == "train" else np.arange(len(src))  # rows of `raw` the encodings belong to
        if name == "train":
            ok, more = length_filter(d, src.lengths, tgt.lengths)
            counts.update(more)
            if not ok.any():
                raise DataError(f"{d.path}: no training pairs left within data.max_len {d.max_len} and data.max_ratio {d.max_ratio}")
            index = np.flatnonzero(ok)
            src, tgt, raw_index = src.select(index), tgt.select(index), raw_index[index]
        raw_src, raw_tgt = raw[name]
        _save_split(data_dir, name, src, tgt, [raw_src[i] for i in raw_index], [raw_tgt[i] for i in raw_index])
        summary_splits[name] = {"lines": len(raw_src), "pairs": len(src), "src_tokens": int(src.lengths.sum()),
                                "tgt_tokens": int(tgt.lengths.sum())}
    summary = {
        "run_dir": str(run_dir), "tokenizer": tok_state, "joint": tokenizer.joint,
        "src_vocab_size": tokenizer.src_vocab_size, "tgt_vocab_size": tokenizer.tgt_vocab_size,
        "splits": summary_splits, "dropped": counts,
    }
    # Written last: its key vouches for every file above.
    atomic_write_text(data_dir / "meta.json", json.dumps({"key": data_key, "files": all_prints, "summary": summary}, indent=1))
    return {**summary, "cached": False, "seconds": round(time.perf_counter() - start, 3)}


def format_summary(summary: dict) -> str:
    """Human-readable report of a `prepare` summary (what `tcli prepare` prints on stdout)."""
    state = "cached (nothing to do)" if summary.get("cached") else f"tokenizer {summary['tokenizer']}"
    vocab = (f"joint vocabulary {summary['src_vocab_size']}" if summary["joint"]
             else f"vocabularies src {summary['src_vocab_size']} / tgt {summary['tgt_vocab_size']}")
    lines = [f"prepared {summary['run_dir']}: {state}, {vocab}, {summary['seconds']:.2f}s"]
    for name, s in summary["splits"].items():
        lines.append(f"  {name:5s} {s['lines']:>9,} lines -> {s['pairs']:>9,} pairs, "
                     f"{s['src_tokens']:>11,} src / {s['tgt_tokens']:>11,} tgt tokens")
    dropped = ", ".join(f"{k} {v:,}" for k, v in summary["dropped"].items())
    lines.append(f"  dropped from train: {dropped}")
    return "\n".join(lines)
