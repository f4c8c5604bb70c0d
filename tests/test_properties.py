"""Property tests (issue 6, hypothesis): random text through translate and random configs through the loader.

- Any UTF-8 text, one sentence a line, translates without an exception into as many lines as it
  came in (in-process on a small untrained model, and once through `tcli translate`).
- Any nested dict (real keys mixed with junk keys, values of random types) either loads into a
  Config that validates and round-trips, or raises ConfigError with a one-line message; so does any
  `--set` list. Nothing else may escape: that would be a traceback for the user.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import math
import subprocess
import sys

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformer_cli.config import CHOICES, SECTIONS, Config, from_dict, load_config, parse_overrides, validate
from transformer_cli.errors import ConfigError

from .conftest import ROOT

# Sentences: any Unicode scalar value but the one line break `tcli translate` splits on (\r, U+2028 stay in).
LINE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=80)
FAST = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, multi30k):
    """A run dir with the smoke config, a tokenizer on 300 Multi30k pairs and an untrained model."""
    from transformer_cli.checkpoint import write_checkpoint
    from transformer_cli.config import save_config
    from transformer_cli.model import build_model
    from transformer_cli.tokenizer import train_tokenizer

    run = tmp_path_factory.mktemp("properties") / "run"
    cfg = load_config(ROOT / "configs" / "smoke.yaml", ["tokenizer.vocab_size=500", "decode.beam=2"])
    cfg.run_dir = str(run)
    texts = []
    for lang in ("de", "en"):
        with gzip.open(multi30k / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            texts.append([next(f).rstrip("\n") for _ in range(300)])
    tokenizer = train_tokenizer(cfg.tokenizer, texts[0], texts[1], run / "tokenizer")
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    with torch.no_grad():  # large random weights: outputs of any token, byte pieces included
        for p in model.parameters():
            p.normal_(0.0, 0.5)
        # ...and a pull towards the pieces <0x0A> and <0x0D>: about 1 output in 4 holds \n or \r.
        line_breaks = [tokenizer.tgt_sp.piece_to_id(p) for p in ("<0x0A>", "<0x0D>")]
        model.decoder_norm.bias += 0.6 * model.output.weight[line_breaks].sum(0)
    write_checkpoint(run / "checkpoints" / "best", model, {"step": 0})
    save_config(cfg, run / "config.yaml")
    return run


@pytest.fixture(scope="module")
def translator(run_dir):
    from transformer_cli import Translator

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only wait on the shared CPU
    yield Translator.from_run_dir(run_dir)
    torch.set_num_threads(threads)


@FAST
@given(st.lists(LINE, max_size=6))
def test_random_text_translates_line_for_line(translator, lines):
    out = translator.translate(lines)
    assert len(out) == len(lines)
    assert all(isinstance(x, str) for x in out)
    assert all(x == "" for x, line in zip(out, lines) if not line.strip())  # empty lines stay empty


@FAST
@given(st.lists(LINE, max_size=6), st.integers(1, 4))
def test_random_text_through_the_command_stream_keeps_lines(translator, lines, buffer_size):
    """What `tcli translate` does with its input bytes: one output line per input line, whatever the model says."""
    from transformer_cli.translator import translate_stream_to

    written: list[str] = []
    data = io.BytesIO("".join(line + "\n" for line in lines).encode("utf-8"))
    count = translate_stream_to(translator, data, "stdin", written.append, buffer_size, quiet=True)
    assert count == len(written) == len(lines)
    assert all(w.endswith("\n") and w.count("\n") == 1 and "\r" not in w for w in written)


@settings(deadline=None, max_examples=1, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(LINE, min_size=3, max_size=12))
def test_random_text_through_tcli_translate(run_dir, lines):
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    result = subprocess.run([sys.executable, "-m", "transformer_cli", "translate", "--run-dir", str(run_dir), "-q"],
                            input=data, capture_output=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode("utf-8").count("\n") == len(lines)


# ----------------------------------------------------------------------------- configs

REAL_KEYS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
FIELD_TYPES = {f"{name}.{f.name}": getattr(f.type, "__name__", f.type)  # "int", "float", ...
               for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.integers(), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["relu", "bpe", "bf16", "cosine", "bleu", "test", "1e-3", "auto"]),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=5), SCALARS, max_size=2))
JUNK = st.text(max_size=10)


def typed_value(key: str):
    """Values of the key's own type (often valid, so that many configs load) with edge cases: 0, <0, nan, inf."""
    typ = FIELD_TYPES[key]
    if typ == "int":
        return st.one_of(st.sampled_from([0, 1, 2, 8, 64]), st.integers(-2, 5000))
    if typ == "float":
        return st.one_of(st.sampled_from([0.0, 0.1, 0.5, math.nan, math.inf]), st.floats(allow_nan=True),
                         st.floats(-1.0, 2.0), st.integers(-1, 10))
    if typ == "bool":
        return st.booleans()
    if typ == "list":
        return st.lists(st.one_of(st.floats(-0.5, 1.5), SCALARS), max_size=3)
    return st.one_of(st.sampled_from(CHOICES.get(key, ("text",))), st.text(max_size=8))


@st.composite
def raw_configs(draw):
    """A nested dict like a YAML config: mostly real sections and keys, some junk, values of any type."""
    raw = {}
    for _ in range(draw(st.integers(0, 4))):
        pick = draw(st.integers(0, 5))  # mostly real sections
        section = draw(JUNK) if pick == 0 else "run_dir" if pick == 1 else draw(st.sampled_from(list(SECTIONS)))
        if section == "run_dir":
            raw[section] = draw(VALUES)
            continue
        keys = REAL_KEYS.get(section, [])
        body = {}
        for _ in range(draw(st.integers(0, 4))):
            key = draw(st.sampled_from(keys) if keys and draw(st.integers(0, 4)) else JUNK)
            typed = key in keys and draw(st.integers(0, 3))
            body[key] = draw(typed_value(f"{section}.{key}") if typed else VALUES)
        raw[section] = body if draw(st.integers(0, 9)) else draw(VALUES)  # sometimes not a mapping
    return raw if draw(st.integers(0, 19)) else draw(VALUES)  # sometimes not a mapping at all


def loads_or_one_line_error(load) -> Config | None:
    """Call load(); a ConfigError must be one line; anything but ConfigError fails the test."""
    try:
        cfg = load()
    except ConfigError as e:
        assert "\n" not in str(e) and str(e), repr(str(e))
        return None
    assert isinstance(cfg, Config)
    validate(cfg)
    floats = [v for section in cfg.to_dict().values() if isinstance(section, dict)
              for v in section.values() if isinstance(v, float)]
    assert all(math.isfinite(v) for v in floats)
    assert from_dict(cfg.to_dict()) == cfg  # what loads also round-trips
    return cfg


@settings(deadline=None, max_examples=300)
@given(raw_configs())
def test_random_config_dicts_load_or_raise_config_error(raw):
    loads_or_one_line_error(lambda: from_dict(raw))


@settings(deadline=None, max_examples=300)
@given(st.sampled_from(sorted(FIELD_TYPES)).flatmap(lambda k: st.tuples(st.just(k), st.one_of(typed_value(k), VALUES))))
def test_every_key_with_random_values_loads_or_raises_config_error(key_value):
    key, value = key_value
    section, name = key.split(".")
    loads_or_one_line_error(lambda: from_dict({section: {name: value}}))


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw_configs())
def test_random_yaml_files_load_or_raise_config_error(tmp_path, raw):
    path = tmp_path / "random.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True), encoding="utf-8")
    loads_or_one_line_error(lambda: load_config(path))


SET_KEY = st.one_of(st.sampled_from([f"{s}.{k}" for s, ks in REAL_KEYS.items() for k in ks] + ["run_dir"]), JUNK)
SET_TEXT = st.one_of(st.builds(lambda k, v: f"{k}={v}", SET_KEY, st.one_of(
    st.text(max_size=10), SCALARS.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("\n...")))),
    st.text(max_size=20))


@settings(deadline=None, max_examples=200)
@given(st.lists(SET_TEXT, max_size=4))
def test_random_overrides_load_or_raise_config_error(overrides):
    loads_or_one_line_error(lambda: from_dict(parse_overrides(overrides)))
    loads_or_one_line_error(lambda: load_config(ROOT / "configs" / "smoke.yaml", overrides))
