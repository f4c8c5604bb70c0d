"""Subword regularisation: each epoch trains on a freshly sampled segmentation (Kudo, 2018).

`tcli prepare` stores one fixed segmentation of the training text. With `train.subword_alpha` > 0 the
trainer re-encodes that text at the start of every epoch with sentencepiece's sampling (unigram: a
segmentation drawn from the `subword_nbest` best with sharpness alpha; bpe: BPE-dropout with
probability alpha), so the model sees many segmentations of each word. Validation, `translate` and
`eval` keep the fixed segmentation.

Sentencepiece's sampler cannot be replayed: `set_random_generator_seed` gives the same samples
only inside one process (google/sentencepiece#609), so each epoch's sample is saved in
`RUN_DIR/subword/` when it is drawn. A `--resume` reloads it and continues on exactly the batches it
stopped in, and every torchrun rank reads the one rank 0 drew.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import Config
from .data import EncodedSplit, Ragged, normalize, read_ids, write_ids
from .errors import DataError
from .tokenizer import Tokenizer

FOLDER = "subword"


def sampled_split(split: EncodedSplit, tokenizer: Tokenizer, cfg: Config, chunk: int = 1 << 16) -> EncodedSplit:
    """The training split re-encoded with a sampled segmentation; pairs it would push past data.max_len keep theirs."""
    t, d = cfg.train, cfg.data
    norm = normalize if d.normalize_whitespace else (lambda x: x)  # the text as `prepare` encoded it
    src_parts, tgt_parts = [], []
    for start in range(0, len(split), chunk):  # in chunks, so a large corpus never exists as one list of ints
        src_text, tgt_text = split.src_text[start:start + chunk], split.tgt_text[start:start + chunk]
        src = tokenizer.encode_src([norm(x) for x in src_text], d.num_proc, t.subword_alpha, t.subword_nbest)
        tgt = tokenizer.encode_tgt([norm(x) for x in tgt_text], d.num_proc, t.subword_alpha, t.subword_nbest)
        for i in range(len(src)):
            if len(src[i]) > d.max_len or len(tgt[i]) > d.max_len:
                src[i], tgt[i] = split.src[start + i].tolist(), split.tgt[start + i].tolist()
        src_parts.append(Ragged.from_lists(src))
        tgt_parts.append(Ragged.from_lists(tgt))
    return EncodedSplit(Ragged.concat(src_parts), Ragged.concat(tgt_parts), split.text_path)


def sample_path(run_dir: Path, epoch: int) -> Path:
    return Path(run_dir) / FOLDER / f"epoch_{epoch:05d}.npz"


def save_sample(run_dir: Path, epoch: int, split: EncodedSplit) -> None:
    """Write the epoch's sample atomically; keep it, the previous epoch's (the last checkpoint may be in it)
    and epoch 1's (its batch count plans the schedule, so a resumed run must plan with the same one)."""
    write_ids(sample_path(run_dir, epoch), split.src, split.tgt)
    for old in (Path(run_dir) / FOLDER).glob("epoch_*.npz"):
        if "epoch_00001" < old.stem < f"epoch_{epoch - 1:05d}":
            old.unlink(missing_ok=True)


def load_sample(run_dir: Path, epoch: int, split: EncodedSplit) -> EncodedSplit | None:
    """The saved sample of this epoch (None when there is none); checked against the prepared split."""
    path = sample_path(run_dir, epoch)
    if not path.is_file():
        return None
    try:
        src, tgt = read_ids(path)
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path}: cannot read the saved subword sample ({e}); delete it to draw a new one") from None
    if len(src) != len(split) or len(tgt) != len(split):
        raise DataError(f"{path}: holds {len(src)} pairs but the prepared training split has {len(split)}; "
                        f"delete {path.parent} to draw new samples")
    return EncodedSplit(src, tgt, split.text_path)


def mean_growth(fixed: EncodedSplit, sampled: EncodedSplit) -> float:
    """How much longer the sampled segmentation is, in tokens of both sides (1.0 = the same)."""
    before = int(fixed.src_lens.sum() + fixed.tgt_lens.sum())
    return float(np.sum(sampled.src_lens) + np.sum(sampled.tgt_lens)) / max(before, 1)
