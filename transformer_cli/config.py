"""Typed configs: one YAML file with sections data, tokenizer, model, train, decode, eval.

Every field and its default is declared once, in the dataclasses below; `docs/config.md` is the
reference a user reads. Loading goes through `yaml.safe_load`, so a file cannot run code.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

NUM_SPECIAL_TOKENS = 4  # pad, unk, bos, eos (see tokenizer.py)


@dataclass
class DataConfig:
    """Where the parallel text comes from and how training pairs are cleaned."""

    format: str = "text"  # text | tsv | jsonl | hub
    path: str = "data/multi30k"  # folder of the files (text/tsv/jsonl), or hub dataset name
    src_lang: str = "de"  # source language code (file suffix / column)
    tgt_lang: str = "en"  # target language code (file suffix / column)
    extra_src_langs: list = field(default_factory=list)  # text: more source languages whose train files align with the target's (many-to-one)
    train_split: str = "train"  # file stem (text: train.de.gz) or hub split name
    valid_split: str = "val"  # validation split (model selection)
    test_split: str = "test_2016_flickr"  # test split (final scores only)
    src_field: str = ""  # tsv/jsonl/hub column of the source (default: src_lang)
    tgt_field: str = ""  # tsv/jsonl/hub column of the target (default: tgt_lang)
    translation_field: str = ""  # hub: dict column holding {src_lang: ..., tgt_lang: ...} (wmt14)
    hub_config: str = ""  # hub: dataset config name, e.g. "de-en"
    download: bool = True  # fetch Multi30k into `path` when its files are missing
    max_train_pairs: int = 0  # keep the first N training pairs (0 = all)
    normalize_whitespace: bool = True  # collapse runs of whitespace, strip ends
    max_len: int = 128  # drop training pairs longer than this many subword tokens on either side
    max_ratio: float = 3.0  # drop training pairs whose length ratio exceeds this (0 = off)
    dedup: bool = False  # drop repeated training pairs
    num_proc: int = 1  # processes for encoding
    target_order: str = "l2r"  # l2r | r2l: r2l trains a right-to-left model (target subwords back to front), a reranking feature

    @property
    def right_to_left(self) -> bool:
        return self.target_order == "r2l"


@dataclass
class TokenizerConfig:
    """Sentencepiece settings."""

    model_type: str = "unigram"  # unigram | bpe
    vocab_size: int = 8000  # subword vocabulary size (per model when not joint)
    joint: bool = True  # one vocabulary for both languages (needed for tied embeddings)
    character_coverage: float = 1.0  # share of characters covered by the vocabulary
    input_sentence_size: int = 1_000_000  # sample at most this many sentences to train on
    byte_fallback: bool = True  # spell unseen characters as UTF-8 byte pieces instead of the unknown id (uses 256 ids)
    seed: int = 1  # seed for sentence sampling


@dataclass
class ModelConfig:
    """Transformer shape."""

    d_model: int = 256  # width of embeddings and hidden states
    num_heads: int = 4  # attention heads; must divide d_model
    ff_size: int = 1024  # inner size of the position-wise feed-forward network
    encoder_layers: int = 3  # encoder blocks
    decoder_layers: int = 3  # decoder blocks
    dropout: float = 0.1  # dropout on embeddings, sublayer outputs and FFN
    attention_dropout: float = 0.0  # dropout on attention weights
    word_dropout: float = 0.0  # training only: zero whole input-token embeddings (source and target), positions kept
    activation: str = "relu"  # relu | gelu
    norm: str = "post"  # post (original paper) | pre (final LayerNorm after each stack)
    tie_embeddings: bool = True  # share source, target and output matrices (joint vocab only)
    max_len: int = 256  # longest input in tokens accepted at decode time (longer is truncated)


@dataclass
class TrainConfig:
    """Optimisation, precision, stopping, validation and checkpointing."""

    seed: int = 1  # seeds data order, dropout and initialisation
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    threads: int = 0  # CPU threads for torch (0 = torch's default)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (CUDA only) | auto (bf16 where the device has native bf16, else fp32)
    max_tokens: int = 4096  # tokens per batch on the larger side, padding included
    update_freq: int = 1  # gradient accumulation steps per update
    optimizer: str = "adam"  # adam | adamw
    lr: float = 5e-4  # peak learning rate
    betas: list = field(default_factory=lambda: [0.9, 0.98])  # Adam betas
    eps: float = 1e-9  # Adam epsilon
    weight_decay: float = 0.0  # decoupled for adamw, L2 for adam
    schedule: str = "inverse_sqrt"  # inverse_sqrt | constant | cosine
    warmup_steps: int = 4000  # linear warmup updates
    min_lr: float = 0.0  # cosine floor
    cycles: int = 1  # cosine only: > 1 restarts it, each cycle's end kept as checkpoints/cycle_K (snapshot ensemble)
    label_smoothing: float = 0.1  # label smoothing of the cross-entropy
    rdrop_alpha: float = 0.0  # > 0: R-Drop, each batch runs twice (two dropout masks, 2x compute) + alpha/4 * their symmetric KL
    subword_alpha: float = 0.0  # > 0: a new sampled segmentation each epoch (unigram: sharpness; bpe: dropout)
    subword_nbest: int = -1  # unigram: sample among the n best segmentations (-1 = all)
    bidirectional_epochs: int = 0  # > 0: the first N epochs also train on every pair reversed (BiT; joint vocab)
    clip_norm: float = 1.0  # 0 = no clipping
    ema_decay: float = 0.0  # > 0 (e.g. 0.999): also keep an exponential moving average of the weights, saved as checkpoints/ema
    max_steps: int = 0  # 0 = no limit
    max_epochs: int = 0  # 0 = no limit
    max_minutes: float = 0.0  # wall-time limit, 0 = no limit
    valid_every: int = 1000  # updates between validations (and checkpoints)
    valid_metric: str = "bleu"  # bleu | chrf | loss
    valid_beam: int = 1  # beam used to decode the validation set (1 = greedy)
    keep_best: int = 5  # best checkpoints kept by valid_metric
    keep_last: int = 10  # periodic checkpoints kept for averaging
    patience: int = 0  # validations without improvement before stopping (0 = off)
    log_every: int = 100  # updates between log lines / metrics rows
    compile: bool = False  # torch.compile the model
    init_from: str = ""  # fine-tune: start from a run dir (its best checkpoint), a checkpoint folder or .safetensors, with its tokenizer


@dataclass
class DecodeConfig:
    """Search settings used by translate, eval and validation."""

    beam: int = 5  # beam size (1 = greedy)
    alpha: float = 0.6  # GNMT length penalty exponent
    max_len_a: float = 1.5  # output at most a * source_length + b tokens
    max_len_b: int = 10  # see max_len_a
    min_len: int = 0  # no end-of-sentence before this many tokens
    max_tokens: int = 8000  # source tokens per decoding batch
    nbest: int = 1  # hypotheses returned per sentence
    mbr: int = 0  # pick among the beam's N best by minimum Bayes risk (0 = off; 2 <= N <= beam)
    mbr_metric: str = "bleu"  # MBR utility: bleu | chrf (sacreBLEU sentence scores)
    sampling: bool = False  # sample instead of search (top_k / top_p / temperature)
    temperature: float = 1.0  # sampling temperature
    top_k: int = 0  # sample from the k most likely tokens (0 = all)
    top_p: float = 1.0  # nucleus sampling mass
    seed: int = 1  # sampling seed (a sentence's samples depend on it and on the sentence only)
    checkpoint: str = "best"  # best | last | averaged | step_N | a folder under checkpoints/ | a .safetensors path
    precision: str = "fp32"  # fp32 | bf16 | fp16 (CUDA only) | auto (bf16 where native, else fp32)
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    threads: int = 0  # CPU threads for torch while decoding (0 = torch's default; 1 is best on a busy CPU)


@dataclass
class EvalConfig:
    """Scoring settings for `tcli eval`."""

    split: str = "test"  # test | valid
    tokenize: str = "13a"  # sacreBLEU tokenizer


@dataclass
class Config:
    """A whole tcli job."""

    run_dir: str = "runs/default"  # where the run writes everything
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {
    "data": DataConfig, "tokenizer": TokenizerConfig, "model": ModelConfig,
    "train": TrainConfig, "decode": DecodeConfig, "eval": EvalConfig,
}

CHOICES = {
    "data.format": ("text", "tsv", "jsonl", "hub"),
    "tokenizer.model_type": ("unigram", "bpe"),
    "model.activation": ("relu", "gelu"),
    "model.norm": ("post", "pre"),
    "train.precision": ("fp32", "bf16", "fp16", "auto"),
    "train.optimizer": ("adam", "adamw"),
    "train.schedule": ("inverse_sqrt", "constant", "cosine"),
    "train.valid_metric": ("bleu", "chrf", "loss"),
    "decode.precision": ("fp32", "bf16", "fp16", "auto"),
    "decode.mbr_metric": ("bleu", "chrf"),
    "data.target_order": ("l2r", "r2l"),
    "eval.split": ("test", "valid"),
}

POSITIVE = {
    "tokenizer.vocab_size", "tokenizer.input_sentence_size", "model.d_model", "model.num_heads",
    "model.ff_size", "model.encoder_layers", "model.decoder_layers", "model.max_len",
    "data.max_len", "data.num_proc", "train.max_tokens", "train.update_freq", "train.lr",
    "train.valid_every", "train.cycles", "train.keep_best", "train.keep_last", "train.log_every", "decode.beam",
    "decode.max_tokens", "decode.nbest", "decode.temperature",
}
NON_NEGATIVE = {
    "data.max_train_pairs", "data.max_ratio", "train.threads", "train.warmup_steps",
    "train.weight_decay", "train.min_lr", "train.clip_norm", "train.max_steps",
    "train.max_epochs", "train.max_minutes", "train.patience", "train.eps", "train.subword_alpha", "train.rdrop_alpha",
    "train.bidirectional_epochs", "decode.max_len_a",
    "decode.max_len_b", "decode.min_len", "decode.top_k", "decode.seed", "decode.threads", "decode.mbr",
}
UNIT_INTERVAL = {"model.dropout", "model.attention_dropout", "model.word_dropout", "train.label_smoothing",
                 "train.ema_decay"}  # [0, 1)


def _all_keys() -> list[str]:
    keys = ["run_dir"]
    for name, cls in SECTIONS.items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _unknown_key(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.5)
    if not close:  # a misspelt field name in the right section: compare the last part only
        tail = key.rsplit(".", 1)[-1]
        close = [k for k in _all_keys() if k.rsplit(".", 1)[-1] in
                 difflib.get_close_matches(tail, [k.rsplit(".", 1)[-1] for k in _all_keys()], n=1)]
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}")  # repr: one line whatever the key


def _coerce(key: str, value: Any, typ: Any, where: str) -> Any:
    """Check `value` against the field type, allowing ints where floats are expected."""
    typ = {"str": str, "int": int, "float": float, "bool": bool, "list": list}.get(typ, typ)
    if typ is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    ok = (
        (typ is bool and isinstance(value, bool))
        or (typ is int and isinstance(value, int) and not isinstance(value, bool))
        or (typ is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (typ is str and isinstance(value, str))
        or (typ is list and isinstance(value, list))
    )
    if not ok:
        return _type_error(key, value, typ, where)
    if typ is float and not math.isfinite(value):  # .nan passes every range check below
        raise ConfigError(f"{where}: key '{key}' must be a finite number, got {value}")
    return float(value) if typ is float else value


def _type_error(key: str, value: Any, typ: Any, where: str):
    raise ConfigError(
        f"{where}: key '{key}' must be {typ.__name__}, got {type(value).__name__} {value!r}"
    )


def from_dict(raw: Any, where: str = "config") -> Config:
    """Build and validate a Config from a nested dict (as read from YAML)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(raw).__name__}")
    cfg = Config()
    for name, value in raw.items():
        if name == "run_dir":
            cfg.run_dir = _coerce("run_dir", value, str, where)
            continue
        if name not in SECTIONS:
            close = difflib.get_close_matches(str(name), list(SECTIONS) + ["run_dir"], n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; sections are {', '.join(SECTIONS)}"
            raise ConfigError(f"{where}: unknown section {str(name)!r}{hint}")
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: section '{name}' must be a mapping, got {type(value).__name__}")
        section = getattr(cfg, name)
        types = {f.name: f.type for f in dataclasses.fields(section)}
        for key, v in value.items():
            full = f"{name}.{key}"
            if key not in types:
                raise _unknown_key(full, where)
            setattr(section, key, _coerce(full, v, types[key], where))
    validate(cfg, where)
    return cfg


def validate(cfg: Config, where: str = "config") -> None:
    """Range and consistency checks, each failing with one line naming the key."""
    def get(key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    for key, choices in CHOICES.items():
        if get(key) not in choices:
            raise ConfigError(f"{where}: key '{key}' must be one of {', '.join(choices)}; got {get(key)!r}")
    for key in POSITIVE:
        if get(key) <= 0:
            raise ConfigError(f"{where}: key '{key}' must be > 0, got {get(key)}")
    for key in NON_NEGATIVE:
        if get(key) < 0:
            raise ConfigError(f"{where}: key '{key}' must be >= 0, got {get(key)}")
    for key in UNIT_INTERVAL:
        if not 0.0 <= get(key) < 1.0:
            raise ConfigError(f"{where}: key '{key}' must be in [0, 1), got {get(key)}")
    m = cfg.model
    if m.d_model % m.num_heads:
        raise ConfigError(
            f"{where}: key 'model.num_heads' ({m.num_heads}) must divide model.d_model ({m.d_model})"
        )
    if cfg.tokenizer.vocab_size <= NUM_SPECIAL_TOKENS:
        raise ConfigError(
            f"{where}: key 'tokenizer.vocab_size' ({cfg.tokenizer.vocab_size}) must exceed the "
            f"{NUM_SPECIAL_TOKENS} special tokens"
        )
    if not 0.0 < cfg.tokenizer.character_coverage <= 1.0:
        raise ConfigError(f"{where}: key 'tokenizer.character_coverage' must be in (0, 1]")
    if not 0.0 < cfg.decode.top_p <= 1.0:
        raise ConfigError(f"{where}: key 'decode.top_p' must be in (0, 1]")
    d = cfg.decode
    if d.mbr and (d.mbr < 2 or d.mbr > d.beam or d.sampling):
        raise ConfigError(f"{where}: key 'decode.mbr' chooses among the beam's n best and must be 0 (off) or "
                          f"2..decode.beam ({d.beam}) with decode.sampling off, got {d.mbr}")
    if len(cfg.train.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.train.betas):
        raise ConfigError(f"{where}: key 'train.betas' must be two numbers in [0, 1), got {cfg.train.betas}")
    if cfg.train.subword_nbest == 0 or cfg.train.subword_nbest < -1:
        raise ConfigError(f"{where}: key 'train.subword_nbest' must be -1 (all) or >= 1, got {cfg.train.subword_nbest}")
    if cfg.tokenizer.model_type == "bpe" and cfg.train.subword_alpha >= 1:
        raise ConfigError(f"{where}: key 'train.subword_alpha' is the BPE-dropout probability for a bpe "
                          f"tokenizer and must be < 1, got {cfg.train.subword_alpha}")
    if cfg.train.cycles > 1 and cfg.train.schedule != "cosine":
        raise ConfigError(f"{where}: key 'train.cycles' ({cfg.train.cycles}) restarts the cosine schedule; "
                          f"set train.schedule: cosine (got {cfg.train.schedule})")
    if cfg.train.bidirectional_epochs and not cfg.tokenizer.joint:
        raise ConfigError(f"{where}: key 'train.bidirectional_epochs' trains on reversed pairs, which needs one "
                          "vocabulary for both sides: set tokenizer.joint: true")
    if cfg.train.bidirectional_epochs and cfg.data.right_to_left:
        raise ConfigError(f"{where}: key 'train.bidirectional_epochs' would feed right-to-left targets to the encoder; "
                          "it cannot be combined with data.target_order: r2l")
    if cfg.data.src_lang == cfg.data.tgt_lang:
        raise ConfigError(f"{where}: keys 'data.src_lang' and 'data.tgt_lang' must differ")
    extra = cfg.data.extra_src_langs
    if extra and cfg.data.format != "text":
        raise ConfigError(f"{where}: key 'data.extra_src_langs' needs data.format: text (aligned files train.<lang>)")
    if not all(isinstance(x, str) and x for x in extra) or len(set(extra)) < len(extra) \
            or {cfg.data.src_lang, cfg.data.tgt_lang} & set(extra):
        raise ConfigError(f"{where}: key 'data.extra_src_langs' must list distinct language codes other than "
                          f"data.src_lang and data.tgt_lang, got {extra!r}")
    if m.tie_embeddings and not cfg.tokenizer.joint:
        raise ConfigError(
            f"{where}: key 'model.tie_embeddings' needs a joint vocabulary (set tokenizer.joint: true)"
        )


def parse_overrides(overrides: list[str] | None) -> dict:
    """Turn ["train.lr=3e-4", "model.d_model=512"] into a nested dict; values are YAML scalars."""
    nested: dict = {}
    for item in overrides or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=3e-4")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: the value is not a valid YAML scalar") from None
        parts = key.split(".")
        if len(parts) > 2 or (len(parts) == 1 and key != "run_dir"):
            if key not in _all_keys():
                raise _unknown_key(key, "--set")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return nested


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: Path) -> Any:
    """Read a YAML file safely; a missing file or bad syntax is a one-line ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file ({e.__class__.__name__}: {e})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}:{line}: invalid YAML ({problem})") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when path is None) and apply --set overrides."""
    raw = read_yaml(Path(path)) if path is not None else {}
    where = str(path) if path is not None else "config"
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections")
    extra = parse_overrides(overrides)
    return from_dict(_merge(raw or {}, extra), where if not extra else f"{where} (with --set)")


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML, atomically."""
    from .io_utils import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def _field_comments(cls) -> dict[str, str]:
    """The trailing `# comment` of each field line in a dataclass's source: the key's help text."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.*)$", line)
        if match:
            comments[match.group(1)] = match.group(2)
    return comments


def config_fields() -> list[tuple[str, str, Any, str]]:
    """(key, type name, default, help) for every field: the reference table in docs/config.md."""
    rows = [("run_dir", "str", Config().run_dir, _field_comments(Config)["run_dir"])]
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        helps = _field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            typ = getattr(hints[f.name], "__name__", str(hints[f.name]))
            rows.append((f"{name}.{f.name}", typ, default, helps.get(f.name, "")))
    return rows


def config_doc() -> str:
    """Markdown reference of every config key (docs/config.md is this text)."""
    lines = [
        "# Config reference",
        "",
        "Every key a tcli config accepts, its type and default. Generated by `tcli config --doc`",
        "from `transformer_cli/config.py` (a test keeps this file in sync). Override any key on the",
        "command line with `--set section.key=value`.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for key, typ, default, help_text in config_fields():
        lines.append(f"| `{key}` | {typ} | `{yaml.safe_dump(default, default_flow_style=True).strip().removesuffix(chr(10) + '...')}` | {help_text.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"
