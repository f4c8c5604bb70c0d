"""Sentencepiece tokenizers: train (joint or separate source/target models), save, load, encode, decode.

The special ids are fixed for every model tcli trains, so the model, batching and search code can
use the constants below without asking the tokenizer.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
from pathlib import Path
from typing import Iterable, Sequence

from .config import TokenizerConfig
from .errors import DataError
from .io_utils import atomic_write_bytes, atomic_write_text

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
SPECIAL_IDS = {"pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID}
_DROP_ON_DECODE = {PAD_ID, BOS_ID, EOS_ID}  # UNK stays: it decodes to a visible " ⁇ "

META_FILE = "tokenizer.json"
JOINT_FILE, SRC_FILE, TGT_FILE = "joint.model", "src.model", "tgt.model"
MODEL_FILES = (JOINT_FILE, SRC_FILE, TGT_FILE)


def _spm():
    import sentencepiece  # imported lazily: `tcli --help` should not pay for it

    return sentencepiece


def _as_list(ids) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]  # numpy/torch ints too


def _encode(sp, texts: Sequence[str], num_threads: int, alpha: float, nbest: int) -> list[list[int]]:
    if alpha > 0:
        return sp.encode(list(texts), out_type=int, num_threads=num_threads, enable_sampling=True,
                         alpha=alpha, nbest_size=nbest)
    return sp.encode(list(texts), out_type=int, num_threads=num_threads)


class Tokenizer:
    """A source and a target sentencepiece model (the same object when the vocabulary is joint).

    right_to_left: target ids run back to front (data.target_order: r2l), so a model trained on them
    writes the last subword first; decode_tgt turns them round again before detokenizing.
    """

    def __init__(self, src_sp, tgt_sp=None, right_to_left: bool = False):
        self.src_sp = src_sp
        self.tgt_sp = tgt_sp if tgt_sp is not None else src_sp
        self.joint = tgt_sp is None or tgt_sp is src_sp
        self.right_to_left = right_to_left

    def oriented(self, right_to_left: bool) -> "Tokenizer":
        """The same subword models with the given target order."""
        return Tokenizer(self.src_sp, self.tgt_sp, right_to_left)

    @property
    def src_vocab_size(self) -> int:
        return self.src_sp.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt_sp.get_piece_size()

    def encode_src(self, texts: Sequence[str], num_threads: int = 1, alpha: float = 0.0, nbest: int = -1) -> list[list[int]]:
        """Source texts to bare subword ids (no BOS/EOS); alpha > 0 samples a segmentation (see subword.py)."""
        return _encode(self.src_sp, texts, num_threads, alpha, nbest)

    def encode_tgt(self, texts: Sequence[str], num_threads: int = 1, alpha: float = 0.0, nbest: int = -1) -> list[list[int]]:
        """Target texts to bare subword ids (no BOS/EOS), in the model's order; alpha > 0 samples a segmentation."""
        ids = _encode(self.tgt_sp, texts, num_threads, alpha, nbest)
        return [x[::-1] for x in ids] if self.right_to_left else ids

    def decode_src(self, ids_list: Iterable) -> list[str]:
        """Source ids back to text; pad/bos/eos are dropped."""
        return [self.src_sp.decode([i for i in _as_list(ids) if i not in _DROP_ON_DECODE]) for ids in ids_list]

    def decode_tgt(self, ids_list: Iterable) -> list[str]:
        """Target ids (in the model's order) back to text; pad/bos/eos are dropped."""
        step = -1 if self.right_to_left else 1
        return [self.tgt_sp.decode([i for i in _as_list(ids)[::step] if i not in _DROP_ON_DECODE]) for ids in ids_list]

    def src_pieces(self, ids) -> list[str]:
        """Subword strings of source ids (labels for attention plots)."""
        return [self.src_sp.id_to_piece(i) for i in _as_list(ids)]

    def tgt_pieces(self, ids) -> list[str]:
        """Subword strings of target ids, in the model's order (labels for attention plots)."""
        return [self.tgt_sp.id_to_piece(i) for i in _as_list(ids)]

    @classmethod
    def load(cls, folder: str | Path, right_to_left: bool = False) -> "Tokenizer":
        """Load the model(s) a `train_tokenizer` call saved in `folder`."""
        folder = Path(folder)
        meta_path = folder / META_FILE
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError(f"{meta_path}: no tokenizer there; run `tcli prepare` first") from None
        except (OSError, ValueError) as e:
            raise DataError(f"{meta_path}: cannot read the tokenizer description ({e}); rerun `tcli prepare`") from None
        if meta.get("joint"):
            return cls(_load_model(folder / JOINT_FILE), right_to_left=right_to_left)
        return cls(_load_model(folder / SRC_FILE), _load_model(folder / TGT_FILE), right_to_left)


def _load_model(path: Path):
    """Load one .model file, checking that it is sentencepiece and uses tcli's special ids."""
    if not path.is_file():
        raise DataError(f"{path}: sentencepiece model file is missing; rerun `tcli prepare`")
    return _from_proto(path.read_bytes(), str(path))


def _from_proto(proto: bytes, name: str):
    sp = _spm().SentencePieceProcessor()
    try:
        sp.load_from_serialized_proto(proto)
    except (RuntimeError, OSError, TypeError) as e:
        raise DataError(f"{name}: not a sentencepiece model file; rerun `tcli prepare` to rebuild it") from None
    got = {"pad_id": sp.pad_id(), "unk_id": sp.unk_id(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id()}
    if sp.get_piece_size() <= EOS_ID or got != SPECIAL_IDS:
        raise DataError(f"{name}: sentencepiece model has special ids {got}, tcli needs {SPECIAL_IDS}")
    return sp


def _train_one(cfg: TokenizerConfig, texts: Sequence[str], name: str, verbose: bool = False) -> bytes:
    """Train one sentencepiece model on a list of sentences; returns the serialized model."""
    spm = _spm()
    if len(texts) > cfg.input_sentence_size:
        # Sampled here, not by sentencepiece: its sampler ignores every seed we can give it.
        rng = random.Random(cfg.seed)
        texts = [texts[i] for i in sorted(rng.sample(range(len(texts)), cfg.input_sentence_size))]
    writer = io.BytesIO()
    options = dict(
        sentence_iterator=iter(texts), model_writer=writer, vocab_size=cfg.vocab_size,
        model_type=cfg.model_type, character_coverage=cfg.character_coverage,
        byte_fallback=cfg.byte_fallback, **SPECIAL_IDS,
        # No Unicode normalisation: decode(encode(x)) == x, so references are never altered.
        normalization_rule_name="identity", num_threads=max(1, os.cpu_count() or 1),
        minloglevel=0 if verbose else 2,  # sentencepiece logs hundreds of lines otherwise
    )
    try:
        spm.SentencePieceTrainer.train(**options)
    except RuntimeError as e:
        message = str(e)
        too_small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
        too_large = re.search(r"too high.*<=\s*(\d+)", message)
        if too_small:
            raise DataError(
                f"{name}: key 'tokenizer.vocab_size' ({cfg.vocab_size}) is too small: the characters "
                f"and special pieces need at least {too_small.group(1)} (byte_fallback adds 256)"
            ) from None
        if too_large:
            raise DataError(
                f"{name}: key 'tokenizer.vocab_size' ({cfg.vocab_size}) is too large for this training "
                f"text (at most {too_large.group(1)}); lower it or add data"
            ) from None
        raise DataError(f"{name}: sentencepiece training failed: {message.splitlines()[0]}") from None
    return writer.getvalue()


def _vocab_text(sp) -> str:
    """The `piece<TAB>score` listing sentencepiece's command line writes next to a model."""
    return "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))


def _clear(folder: Path) -> None:
    """Remove a saved tokenizer, its description first: a crash after this must not leave old + new files
    looking valid."""
    (folder / META_FILE).unlink(missing_ok=True)
    for stale in MODEL_FILES:
        for path in (folder / stale, (folder / stale).with_suffix(".vocab")):
            path.unlink(missing_ok=True)


def model_files(folder: str | Path) -> list[Path]:
    """The sentencepiece model files a saved tokenizer consists of."""
    return [Path(folder) / f for f in MODEL_FILES if (Path(folder) / f).is_file()]


def copy_tokenizer(source: str | Path, folder: str | Path, extra_meta: dict | None = None) -> Tokenizer:
    """Copy a saved tokenizer into `folder` (fine-tuning keeps the subwords the weights were trained on)."""
    source, folder = Path(source), Path(folder)
    tok = Tokenizer.load(source)  # checks it before anything is replaced
    meta = json.loads((source / META_FILE).read_text(encoding="utf-8"))
    folder.mkdir(parents=True, exist_ok=True)
    _clear(folder)
    for path in model_files(source):
        for file in (path, path.with_suffix(".vocab")):
            if file.is_file():
                atomic_write_bytes(folder / file.name, file.read_bytes())
    meta = {**meta, **(extra_meta or {})}
    atomic_write_text(folder / META_FILE, json.dumps(meta, indent=2) + "\n")  # last, as in train_tokenizer
    return tok


def train_tokenizer(
    cfg: TokenizerConfig, src_texts: Sequence[str], tgt_texts: Sequence[str], folder: str | Path,
    verbose: bool = False, extra_meta: dict | None = None,
) -> Tokenizer:
    """Train a joint or a separate source/target sentencepiece model, save it in `folder`, return it."""
    folder = Path(folder)
    _clear(folder)
    if cfg.joint:
        models = {JOINT_FILE: _train_one(cfg, [*src_texts, *tgt_texts], "joint tokenizer", verbose)}
    else:
        models = {SRC_FILE: _train_one(cfg, src_texts, "source tokenizer", verbose),
                  TGT_FILE: _train_one(cfg, tgt_texts, "target tokenizer", verbose)}
    processors = {}
    for file, proto in models.items():
        processors[file] = _from_proto(proto, file)
        atomic_write_bytes(folder / file, proto)
        atomic_write_text((folder / file).with_suffix(".vocab"), _vocab_text(processors[file]))
    tok = Tokenizer(processors[JOINT_FILE]) if cfg.joint else Tokenizer(processors[SRC_FILE], processors[TGT_FILE])
    meta = {
        "joint": cfg.joint, **SPECIAL_IDS, "src_vocab_size": tok.src_vocab_size,
        "tgt_vocab_size": tok.tgt_vocab_size, "settings": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        **(extra_meta or {}),
    }
    # Written last: a folder without tokenizer.json is an unfinished one.
    atomic_write_text(folder / META_FILE, json.dumps(meta, indent=2) + "\n")
    return tok
