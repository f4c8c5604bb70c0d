"""The Python API for a trained run: `Translator.from_run_dir(path).translate(list_of_str)`.

`tcli translate`, `tcli eval` and `tcli attention` all go through this class. Text in, text out:
sentencepiece encode, length-bucketed batches (search.py), sentencepiece decode, input order.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from .config import Config, DecodeConfig, from_dict, read_yaml
from .device import resolve_precision
from .errors import ConfigError, DataError
from .search import Hypothesis, decode_nbest
from .tokenizer import EOS_ID


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Translator:
    """A model, its tokenizer and decoding settings; translates lists or streams of sentences."""

    def __init__(self, model, tokenizer, cfg: Config, device: torch.device, checkpoint: Path | None = None,
                 members: Sequence[Path] = ()):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.cfg = cfg
        # decode.precision auto becomes bf16 or fp32 for this device; fp16 on a CPU is a ConfigError
        precision, _ = resolve_precision(cfg.decode.precision, device, "decode.precision")
        self.decode_cfg: DecodeConfig = dataclasses.replace(cfg.decode, precision=precision)
        self.device = device
        self.checkpoint = checkpoint
        self.members = list(members)  # the weights files of an ensemble, `checkpoint` first

    @classmethod
    def from_run_dir(cls, path: str | Path, checkpoint: str | None = "best", device: str | None = None,
                     decode: dict | None = None, ensemble: Sequence[str | Path] = ()) -> "Translator":
        """Load run_dir/config.yaml, the tokenizer and a checkpoint (best | last | averaged | path).

        `decode` overrides keys of the config's decode section, e.g. {"beam": 1}. `ensemble` names
        more run dirs (same tokenizer and direction) whose same checkpoint decodes together with
        this one, by the mean of their probabilities (ensemble.py), or checkpoint folders inside
        such run dirs (RUN/checkpoints/NAME), decoded as named; decode settings come from `path`.
        """
        from .device import resolve_device
        from .tokenizer import Tokenizer

        run_dir = Path(path)
        cfg_path = run_dir / "config.yaml"
        raw = _read_run_config(run_dir)
        overrides = {k: v for k, v in (decode or {}).items() if v is not None}
        if overrides and isinstance(raw, dict):
            raw = {**raw, "decode": {**(raw.get("decode") or {}), **overrides}}
        # from_dict checks types and ranges: --beam 0 fails naming decode.beam
        cfg = from_dict(raw, f"{cfg_path} (with options)" if overrides else str(cfg_path))
        if cfg.decode.threads:
            torch.set_num_threads(cfg.decode.threads)  # process-wide, as train.threads does
        checkpoint = checkpoint or cfg.decode.checkpoint
        dev = resolve_device(device or cfg.decode.device)
        tokenizer = Tokenizer.load(run_dir / "tokenizer", cfg.data.right_to_left)
        model, weights = _load_model(run_dir, cfg, tokenizer, checkpoint)
        if not ensemble:
            return cls(model.to(dev), tokenizer, cfg, dev, weights)
        from .ensemble import Ensemble

        models, members = [model], [weights]
        for other, other_checkpoint in (_ensemble_member(Path(e), checkpoint) for e in ensemble):
            other_cfg = from_dict(_read_run_config(other), str(other / "config.yaml"))
            other_tokenizer = Tokenizer.load(other / "tokenizer", other_cfg.data.right_to_left)
            _check_compatible(run_dir, cfg, tokenizer, other, other_cfg, other_tokenizer)
            other_model, other_weights = _load_model(other, other_cfg, other_tokenizer, other_checkpoint)
            models.append(other_model)
            members.append(other_weights)
        ens = Ensemble(models)
        cfg.model = dataclasses.replace(cfg.model, max_len=ens.cfg.max_len)  # every member must take the source
        return cls(ens.to(dev), tokenizer, cfg, dev, weights, members)

    # -- text ---------------------------------------------------------------------------------

    @property
    def max_src_tokens(self) -> int:
        """Longest source (bare subwords) the model accepts; the EOS takes one position."""
        return self.cfg.model.max_len - 1

    def encode(self, texts: Sequence[str], line_numbers: Sequence[int] | None = None,
               warn: Callable[[str], None] | None = _stderr) -> list[list[int]]:
        """Source texts to ids, truncated to the model's limit with a warning naming the line."""
        ids = self.tokenizer.encode_src([self._clean(t) for t in texts])
        limit = self.max_src_tokens
        for i, s in enumerate(ids):
            if len(s) > limit:
                if warn is not None:
                    line = line_numbers[i] if line_numbers is not None else i + 1
                    warn(f"warning: line {line}: {len(s)} subword tokens, truncated to {limit} (model.max_len)")
                ids[i] = s[:limit]
        return ids

    def _clean(self, text: str) -> str:
        """The whitespace normalisation training used."""
        return " ".join(text.split()) if self.cfg.data.normalize_whitespace else text.strip()

    def translate_nbest(self, texts: Sequence[str], nbest: int | None = None, first_line: int = 1,
                        progress: bool = False, warn: Callable[[str], None] | None = _stderr) -> list[list[tuple[str, float]]]:
        """Per input text its n-best (translation, score) pairs; an empty line gives [("", 0.0)]."""
        todo = [i for i, t in enumerate(texts) if t.strip()]
        ids = self.encode([texts[i] for i in todo], [first_line + i for i in todo], warn)
        out: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in texts]
        if not todo:
            return out
        cfg = self.decode_cfg
        want = cfg.nbest if nbest is None else nbest
        hyps = decode_nbest(self.model, ids, cfg, self.device, nbest=max(want, cfg.mbr), progress=progress)
        for i, hs in zip(todo, hyps):
            pairs = list(zip(self.tokenizer.decode_tgt([h.tokens for h in hs]), (h.score for h in hs)))
            if cfg.mbr:  # reorder by expected utility; each keeps its model score
                from .mbr import mbr_order

                pairs = [pairs[j] for j in mbr_order([p[0] for p in pairs], cfg.mbr_metric)]
            out[i] = pairs[:want]
        return out

    def translate(self, texts: Sequence[str], progress: bool = False) -> list[str]:
        """Best translation of every text, in input order (empty lines stay empty)."""
        return [h[0][0] for h in self.translate_nbest(texts, nbest=1, progress=progress)]

    def translate_stream(self, lines: Iterable[str], buffer_size: int = 1000, nbest: int = 1,
                         warn: Callable[[str], None] | None = _stderr) -> Iterator[list[tuple[str, float]]]:
        """Translate lines as they come, `buffer_size` at a time; yields n-best lists in input order."""
        buffer: list[str] = []
        first = 1
        for line in lines:
            buffer.append(line)
            if len(buffer) >= buffer_size:
                yield from self.translate_nbest(buffer, nbest, first, warn=warn)
                first += len(buffer)
                buffer = []
        if buffer:
            yield from self.translate_nbest(buffer, nbest, first, warn=warn)

    def score(self, sources: Sequence[str], targets: Sequence[str], progress: bool = False,
              warn: Callable[[str], None] | None = _stderr) -> list[tuple[float, int]]:
        """Per pair (log P(target | source), target subwords + EOS): natural log, summed (scoring.py)."""
        from .scoring import score_ids

        srcs = self.encode(sources, warn=warn)
        tgts = self.tokenizer.encode_tgt([self._clean(t) for t in targets])
        cfg = self.decode_cfg
        logps = score_ids(self.model, srcs, tgts, self.device, cfg.precision, cfg.max_tokens, progress)
        return [(lp, len(t) + 1) for lp, t in zip(logps, tgts)]

    # -- attention ----------------------------------------------------------------------------

    def attention(self, text: str, beam: int | None = None) -> dict:
        """Translate one text, then rerun the decoder on it with need_weights=True.

        Returns source/target subword labels and per-layer (H, T, S) cross-attention, decoder
        self-attention and encoder self-attention weights.
        """
        if self.members:
            raise ConfigError("attention weights come from one model; load the run without an ensemble")
        (ids,) = self.encode([text])
        (hyps,) = decode_nbest(self.model, [ids], self.decode_cfg, self.device, beam=beam, nbest=1)
        hyp: Hypothesis = hyps[0]
        src = torch.tensor([ids + [EOS_ID]], device=self.device)
        tgt_in = torch.tensor([[2] + hyp.tokens], device=self.device)  # BOS + tokens
        with torch.inference_mode():
            mask = torch.ones_like(src, dtype=torch.bool)
            memory = self.model.encode(src, mask, need_weights=True)
            self.model.decode(tgt_in, memory, mask, need_weights=True)
        w = self.model.attention_weights()
        return {
            "src_pieces": self.tokenizer.src_pieces(ids) + ["</s>"],
            "tgt_pieces": self.tokenizer.tgt_pieces(hyp.tokens) + ["</s>"],
            "translation": self.tokenizer.decode_tgt([hyp.tokens])[0],
            "cross": [x[0].float().cpu() for x in w["cross"]],  # per layer (H, T, S)
            "decoder_self": [x[0].float().cpu() for x in w["decoder_self"]],
            "encoder": [x[0].float().cpu() for x in w["encoder"]],
        }


def _read_run_config(run_dir: Path) -> dict:
    """The raw config.yaml of a trained run directory (a DataError when there is none)."""
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise DataError(f"{cfg_path}: no config.yaml in the run directory; train a model there first")
    return read_yaml(cfg_path) or {}


def _load_model(run_dir: Path, cfg: Config, tokenizer, checkpoint: str):
    """(model on CPU, weights path) of one trained run."""
    from .checkpoint import load_weights, resolve_checkpoint
    from .model import build_model

    model = build_model(cfg, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    weights = resolve_checkpoint(run_dir, checkpoint)
    load_weights(model, weights)
    return model, weights


def _ensemble_member(path: Path, checkpoint: str) -> tuple[Path, str]:
    """(run dir, checkpoint) of an --ensemble value: a run dir, decoded with --checkpoint's name, or
    a checkpoint folder (or its model.safetensors) inside a run dir, decoded as it is."""
    from .checkpoint import checkpoint_in_run, is_checkpoint_name

    inside = checkpoint_in_run(path)
    if inside is not None:
        weights, run = inside
        return run, str(weights)
    if not is_checkpoint_name(checkpoint):
        raise ConfigError(f"--checkpoint '{checkpoint}' is a path, so --ensemble {path} needs its own: name a "
                          "checkpoint folder (RUN/checkpoints/NAME), or use a folder name: best, last, averaged, step_N, ...")
    return path, checkpoint


def _check_compatible(first: Path, cfg: Config, tokenizer, other: Path, other_cfg: Config, theirs) -> None:
    """An ensemble member must translate the same direction with the very same subword models."""
    pair = (cfg.data.src_lang, cfg.data.tgt_lang)
    other_pair = (other_cfg.data.src_lang, other_cfg.data.tgt_lang)
    if pair != other_pair:
        raise ConfigError(f"--ensemble {other}: translates {'-'.join(other_pair)}, "
                          f"but {first} translates {'-'.join(pair)}")
    if other_cfg.data.target_order != cfg.data.target_order:
        raise ConfigError(f"--ensemble {other}: writes targets {other_cfg.data.target_order}, but {first} writes them "
                          f"{cfg.data.target_order} (data.target_order); an ensemble needs one order")
    for side in ("src_sp", "tgt_sp"):
        if getattr(theirs, side).serialized_model_proto() != getattr(tokenizer, side).serialized_model_proto():
            raise ConfigError(f"--ensemble {other}: its tokenizer differs from {first / 'tokenizer'}; "
                              "ensemble members must share one sentencepiece model")


# -- command helpers (tcli translate / eval) ----------------------------------------------------


def decode_lines(stream, name: str) -> Iterator[str]:
    """Lines of a binary stream as text, read one at a time (for pipes); bad UTF-8 is a DataError naming the line."""
    for number, raw in enumerate(iter(stream.readline, b""), 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{name} line {number}: invalid UTF-8 (byte {e.start}); give UTF-8 text") from None
        yield text.rstrip("\n").rstrip("\r")


def score_summary(scored: Sequence[tuple[float, int]]) -> str:
    """One stderr line: pairs, target tokens, mean log-probability per token and perplexity."""
    import math

    if not scored:
        return "scored 0 pairs"
    total = sum(lp for lp, _ in scored)
    tokens = sum(n for _, n in scored)
    mean = total / max(tokens, 1)
    return (f"scored {len(scored)} pairs, {tokens} target tokens: "
            f"{mean:.4f} log-probability per token, perplexity {math.exp(-mean):.2f}")


def one_line(text: str) -> str:
    """A translation as one output line: a model with byte-fallback pieces can emit \\n or \\r."""
    return text.replace("\r", " ").replace("\n", " ")


def format_nbest(hyps: list[tuple[str, float]], with_scores: bool) -> str:
    """One output line: the translation, or `hyp<TAB>score` pairs for n-best output."""
    if not with_scores:
        return one_line(hyps[0][0])
    if len(hyps) == 1 and hyps[0] == ("", 0.0):
        return ""
    return "\t".join(f"{one_line(text).replace(chr(9), ' ')}\t{score:.4f}" for text, score in hyps)


def translate_stream_to(translator: Translator, stream, name: str, write: Callable[[str], None],
                        buffer_size: int, nbest: int = 1, quiet: bool = False) -> int:
    """Translate a binary input stream line by line into `write` (one call per output line); returns the count."""
    import time

    warn = _stderr  # warnings (a truncated line) are not progress: --quiet keeps them
    count, start = 0, time.perf_counter()
    for hyps in translator.translate_stream(decode_lines(stream, name), buffer_size, nbest, warn=warn):
        write(format_nbest(hyps, nbest > 1) + "\n")
        count += 1
    if not quiet:
        secs = time.perf_counter() - start
        warn(f"translated {count} lines from {name} in {secs:.1f} s ({count / max(secs, 1e-9):.1f} lines/s)")
    return count


def checkpoint_label(checkpoint: str) -> str:
    """A short name for file names: best, last, averaged, step_00001000 or a file's stem."""
    path = Path(checkpoint)
    if "/" not in checkpoint and not checkpoint.endswith(".safetensors"):
        return checkpoint
    return path.parent.name if path.name == "model.safetensors" else path.stem


def search_label(base: DecodeConfig, used: DecodeConfig, device: torch.device) -> str:
    """File-name parts for search settings that differ from the run's config, e.g. '.beam1.alpha1.5'.

    Without them a second `tcli eval` of the same checkpoint with another --beam or --alpha
    would replace the first one's hypotheses and scores. `used.precision` is resolved; the
    config's is compared as written, but auto as what it means on `device`.
    """
    precision = resolve_precision("auto", device, "decode.precision")[0] if base.precision == "auto" else base.precision
    parts = [f"beam{used.beam}" if used.beam != base.beam else "",
             f"alpha{used.alpha:g}" if used.alpha != base.alpha else "",
             used.precision if used.precision != precision else ""]
    return "".join(f".{p}" for p in parts if p)


def evaluate_run(run_dir: str | Path, split: str = "test", checkpoint: str | None = None,
                 device: str | None = None, decode: dict | None = None, quiet: bool = False,
                 ensemble: Sequence[str | Path] = ()) -> dict:
    """Decode a prepared split, write hyps/<split>.<label>.txt (and the reference), score it, update scores.json.

    The label is the checkpoint's name, then any search setting that differs from the run's
    config (.beamB, .alphaA, .bf16/.fp32/.fp16), then .mbrN<metric> with MBR, then .ensembleN
    (N models in all) with `ensemble` run dirs, whose scores list every member's weights file.
    """
    import json

    from .data import load_split
    from .io_utils import atomic_write_text
    from .metrics import score_files

    run_dir = Path(run_dir)
    translator = Translator.from_run_dir(run_dir, checkpoint, device=device, decode=decode, ensemble=ensemble)
    data = load_split(run_dir, split)
    hyps = translator.translate(data.src_text, progress=not quiet)
    label = checkpoint_label(checkpoint or translator.cfg.decode.checkpoint)
    run_decode = from_dict(_read_run_config(run_dir), str(run_dir / "config.yaml")).decode  # without the options
    label += search_label(run_decode, translator.decode_cfg, translator.device)
    if translator.decode_cfg.mbr:  # beside, not over, the plain beam's hyps and scores
        label += f".mbr{translator.decode_cfg.mbr}{translator.decode_cfg.mbr_metric}"
    if translator.members:
        label += f".ensemble{len(translator.members)}"
    hyp_path = run_dir / "hyps" / f"{split}.{label}.txt"
    ref_path = run_dir / "hyps" / f"{split}.ref.txt"
    atomic_write_text(hyp_path, "".join(one_line(h) + "\n" for h in hyps))
    atomic_write_text(ref_path, "".join(r + "\n" for r in data.tgt_text))
    scores = score_files(hyp_path, ref_path, translator.cfg.eval.tokenize, translator.cfg.data.tgt_lang)
    scores.update(split=split, checkpoint=str(translator.checkpoint), hyp_file=str(hyp_path),
                  ref_file=str(ref_path), beam=translator.decode_cfg.beam, alpha=translator.decode_cfg.alpha)
    if translator.decode_cfg.mbr:
        scores.update(mbr=translator.decode_cfg.mbr, mbr_metric=translator.decode_cfg.mbr_metric)
    if translator.members:
        scores["ensemble"] = [str(p) for p in translator.members]
    scores_path = run_dir / "scores.json"
    try:
        table = json.loads(scores_path.read_text(encoding="utf-8")) if scores_path.is_file() else {}
    except ValueError:
        table = {}  # a broken file is replaced: it only caches earlier results
    table[f"{split}.{label}"] = scores
    atomic_write_text(scores_path, json.dumps(table, indent=2) + "\n")
    return scores


def draw_attention(translator: Translator, text: str, out: str | Path, layer: str = "all",
                   per_head: bool = False, encoder: bool = False) -> tuple[Path, str]:
    """Translate `text` and draw its cross-attention (or encoder self-attention) to a PNG; returns (path, translation)."""
    from .plots import plot_attention

    if not text.strip():
        raise ConfigError("--text is empty; give a sentence to translate")
    info = translator.attention(text)
    weights = info["encoder"] if encoder else info["cross"]
    if layer == "all":
        layers = list(range(len(weights)))
    elif layer.isdigit() and 1 <= int(layer) <= len(weights):
        layers = [int(layer) - 1]
    else:
        raise ConfigError(f"--layer must be 'all' or a number from 1 to {len(weights)}, got '{layer}'")
    rows = info["src_pieces"] if encoder else info["tgt_pieces"]
    title = "encoder self-attention" if encoder else f"cross-attention: {info['translation']}"
    path = plot_attention(weights, info["src_pieces"], rows, out, layers, per_head, title)
    return path, info["translation"]


def decode_overrides(sets: Sequence[str] | None) -> dict:
    """`--set decode.KEY=VALUE` options as a {KEY: value} dict; other sections are a ConfigError."""
    from .config import parse_overrides

    nested = parse_overrides(list(sets or []))
    other = [name for name in nested if name != "decode"]
    if other:
        raise ConfigError(f"--set: only decode.* keys apply here, got a key of section '{other[0]}'")
    return {k: v for k, v in nested.get("decode", {}).items() if v is not None}
