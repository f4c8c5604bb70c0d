"""Config loading, validation, --set overrides and the key reference."""

from pathlib import Path

import pytest
import yaml

from transformer_cli.config import Config, config_doc, load_config, parse_overrides
from transformer_cli.errors import ConfigError

from .conftest import ROOT, run_tcli

SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_are_shipped():
    names = {p.name for p in SHIPPED}
    assert {"multi30k_de_en.yaml", "multi30k_en_de.yaml", "multi30k_en_fr.yaml", "smoke.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text())
    assert cfg.run_dir == raw["run_dir"]
    for section, values in raw.items():
        if isinstance(values, dict):
            for key, value in values.items():
                got = getattr(getattr(cfg, section), key)
                assert got == (float(value) if isinstance(got, float) else value), f"{section}.{key}"


def test_defaults_without_file():
    assert load_config(None) == Config()


def test_overrides_parse_yaml_scalars():
    cfg = load_config(ROOT / "configs/smoke.yaml", ["train.lr=3e-4", "model.d_model=128", "data.dedup=true",
                                                     "train.betas=[0.9, 0.99]", "run_dir=/tmp/x"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.model.d_model == 128 and cfg.data.dedup is True
    assert cfg.train.betas == [0.9, 0.99] and cfg.run_dir == "/tmp/x"
    assert parse_overrides(["model.dropout=0.3"]) == {"model": {"dropout": 0.3}}


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["model.num_head=8"], "unknown key 'model.num_head'; did you mean model.num_heads?"),
        (["modle.d_model=8"], "unknown section 'modle'; did you mean model?"),
        (["model.d_model=abc"], "key 'model.d_model' must be int"),
        (["model.num_heads=3"], "'model.num_heads' (3) must divide model.d_model (64)"),
        (["model.d_model=0"], "'model.d_model' must be > 0"),
        (["train.max_steps=-1"], "'train.max_steps' must be >= 0"),
        (["model.dropout=1.0"], "'model.dropout' must be in [0, 1)"),
        (["model.word_dropout=-0.1"], "'model.word_dropout' must be in [0, 1)"),
        (["tokenizer.vocab_size=4"], "'tokenizer.vocab_size' (4) must exceed the 4 special tokens"),
        (["model.norm=middle"], "'model.norm' must be one of post, pre"),
        (["train.lr"], "expected KEY=VALUE"),
        (["train.bidirectional_epochs=-1"], "'train.bidirectional_epochs' must be >= 0"),
        (["train.bidirectional_epochs=2", "tokenizer.joint=false", "model.tie_embeddings=false"],
         "'train.bidirectional_epochs' trains on reversed pairs, which needs one vocabulary for both sides"),
        (["train.cycles=0"], "'train.cycles' must be > 0"),
        (["data.target_order=rtl"], "'data.target_order' must be one of l2r, r2l"),
        (["data.target_order=r2l", "train.bidirectional_epochs=1"],
         "'train.bidirectional_epochs' would feed right-to-left targets to the encoder"),
        (["train.cycles=3", "train.schedule=inverse_sqrt"], "'train.cycles' (3) restarts the cosine schedule"),
    ],
)
def test_bad_values_name_the_key(sets, needle):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/smoke.yaml", sets)
    assert needle in str(err.value)


def test_bad_files(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+: invalid YAML"):
        load_config(bad)
    evil = tmp_path / "evil.yaml"
    marker = tmp_path / "pwned"
    evil.write_text(f'!!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(evil)
    assert not marker.exists()
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listing)


def test_cli_config_error_is_one_line_exit_2():
    r = run_tcli("config", "--config", "configs/smoke.yaml", "--set", "model.num_head=8")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: configs/smoke.yaml (with --set): unknown key 'model.num_head'; did you mean model.num_heads?"
    ]
    assert "Traceback" not in r.stderr


def test_cli_config_prints_resolved_yaml():
    r = run_tcli("config", "--config", "configs/smoke.yaml", "--set", "train.lr=1e-4")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["train"]["lr"] == pytest.approx(1e-4)


def test_config_reference_is_in_sync():
    assert (ROOT / "docs" / "config.md").read_text() == config_doc(), "run: tcli config --doc > docs/config.md"
