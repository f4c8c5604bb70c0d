"""scripts/bench_joeynmt.py: the JoeyNMT config it writes, the logs it reads, and the ratio it reports."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

from transformer_cli.config import load_config

from .conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_joeynmt", ROOT / "scripts" / "bench_joeynmt.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

# two lines of a real JoeyNMT 2.3 train.log (2026-12-01), with a validation line between
JOEY_LOG = """\
2026-12-01 10:19:53,827 - INFO - joeynmt.training - Epoch   1, Step:       10, Batch Loss:     7.176014, \
Batch Acc: 0.066496, Tokens per Sec:      680, Lr: 0.000060
2026-12-01 10:20:00,000 - INFO - joeynmt.training - Evaluation result (greedy): bleu:   1.20, loss: 100.0
2026-12-01 10:20:18,047 - INFO - joeynmt.training - Epoch   1, Step:       20, Batch Loss:     6.989035, \
Batch Acc: 0.074385, Tokens per Sec:      665.5, Lr: 0.000120
"""


def test_joey_rates_reads_every_speed_line_in_order():
    assert bench.joey_rates(JOEY_LOG) == [680.0, 665.5]
    assert bench.joey_rates("no speed here") == []


def test_tcli_rates_skips_validation_rows(tmp_path):
    rows = [{"step": 50, "train_loss": 5.0, "tokens_per_s": 7000.5}, {"step": 50, "valid_bleu": 3.1},
            {"step": 100, "train_loss": 4.0, "tokens_per_s": 7100.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.tcli_rates(path) == [7000.5, 7100.0]


def test_joey_vocab_drops_sentencepiece_specials_keeps_order(tmp_path):
    spm_vocab = tmp_path / "joint.vocab"
    spm_vocab.write_text("<pad>\t0\n<unk>\t0\n<s>\t0\n</s>\t0\n<0x00>\t0\n▁a\t-2.5\n▁Mann\t-3.1\n", encoding="utf-8")
    out = tmp_path / "vocab.txt"
    assert bench.joey_vocab(spm_vocab, out) == 3
    assert out.read_text(encoding="utf-8").splitlines() == ["<0x00>", "▁a", "▁Mann"]


@pytest.mark.parametrize("name", ["multi30k_de_en.yaml", "multi30k_de_en_base.yaml"])
def test_joey_config_has_the_tcli_shape(tmp_path, name):
    cfg = load_config(ROOT / "configs" / name)
    joey = bench.joey_config(cfg, tmp_path, tmp_path / "v.txt", tmp_path / "m.model", steps=300, seed=7)
    m = cfg.model
    for side, layers in (("encoder", m.encoder_layers), ("decoder", m.decoder_layers)):
        stack = joey["model"][side]
        assert (stack["num_layers"], stack["hidden_size"], stack["ff_size"], stack["num_heads"]) == (
            layers, m.d_model, m.ff_size, m.num_heads)
        assert stack["dropout"] == stack["embeddings"]["dropout"] == m.dropout
        assert (stack["layer_norm"], stack["embeddings"]["embedding_dim"]) == (m.norm, m.d_model)
    assert joey["model"]["tied_embeddings"] and joey["model"]["tied_softmax"]
    t = joey["training"]
    assert (t["batch_size"], t["batch_type"], t["learning_rate"], t["label_smoothing"]) == (
        cfg.train.max_tokens, "token", cfg.train.lr, cfg.train.label_smoothing)
    assert (t["updates"], t["random_seed"], t["logging_freq"]) == (300, 7, bench.WINDOW)
    assert t["validation_freq"] > t["updates"]  # speed windows hold no validation
    assert joey["data"]["src"]["voc_file"] == joey["data"]["trg"]["voc_file"]  # tied needs one vocabulary
    assert (joey["data"]["src"]["lang"], joey["data"]["trg"]["lang"]) == (cfg.data.src_lang, cfg.data.tgt_lang)


FAKE_JOEY = """\
#!{python}
# Stands in for a JoeyNMT environment: answers the version probe, and for `-m joeynmt train CFG`
# writes a train.log with one speed line per logging window at the rates given in the env.
import os, sys, yaml
from pathlib import Path
if sys.argv[1] == "-c":
    print("joeynmt 2.3.0 torch fake"); sys.exit(0)
assert sys.argv[1:4] == ["-m", "joeynmt", "train"] and "--skip-test" in sys.argv, sys.argv
cfg = yaml.safe_load(Path(sys.argv[4]).read_text())
assert cfg["use_cuda"] is False and Path(cfg["data"]["src"]["voc_file"]).is_file()
assert Path(cfg["data"]["train"] + "." + cfg["data"]["src"]["lang"]).is_file()
model_dir = Path(cfg["model_dir"]); model_dir.mkdir(parents=True, exist_ok=True)
rates = os.environ["FAKE_RATES"].split(",")
t = cfg["training"]
with open(model_dir / "train.log", "w") as f:
    for i in range(t["updates"] // t["logging_freq"]):
        f.write(f"x - INFO - Step: {{i}}, Tokens per Sec: {{rates[i % len(rates)]}}, Lr: 0.1\\n")
"""

TINY = """\
run_dir: runs/unused
data: {{path: {data}, download: false, src_lang: de, tgt_lang: en, max_len: 64, max_train_pairs: 300}}
tokenizer: {{model_type: bpe, vocab_size: 400}}
model: {{d_model: 32, num_heads: 2, ff_size: 64, encoder_layers: 1, decoder_layers: 1, norm: pre}}
train: {{max_tokens: 512, lr: 3e-3, warmup_steps: 5}}
decode: {{max_len_a: 1.2, max_len_b: 3}}
"""


def test_script_reports_the_median_ratio_of_the_logged_windows(tmp_path, multi30k):
    """The whole script with a stand-in JoeyNMT: the ratio must come from both runs' own logs."""
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_JOEY.format(python=sys.executable))
    fake.chmod(0o755)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(data=multi30k))
    out = tmp_path / "speed.json"
    # the first window of each run is dropped: 9999 must not reach the medians
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "FAKE_RATES": "9999,100,300,200"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_joeynmt.py"), "--joey-python", str(fake),
                           "--config", str(config), "--steps", "200", "--repeats", "2",
                           "--variants", "tcli-fp32,joeynmt-fp32", "--work", str(tmp_path / "work"),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    joey = report["results"]["joeynmt-fp32"]
    assert (joey["median_tokens_per_s"], joey["windows"]) == (200.0, 6)  # 3 windows a run after the first
    tcli = report["results"]["tcli-fp32"]
    # each run's windows as logged; the last run's are its metrics.jsonl's (the run dir is kept)
    runs = tcli["runs"]
    assert len(runs) == 2 and runs[-1]["rates"] == bench.tcli_rates(tmp_path / "work" / "tcli_fp32" / "metrics.jsonl")
    assert all(len(r["rates"]) == 4 for r in runs)
    pooled = [x for r in runs for x in r["rates"][1:]]
    assert (tcli["windows"], tcli["median_tokens_per_s"]) == (6, round(statistics.median(pooled), 1))
    assert report["speedup_vs_joeynmt"]["tcli-fp32"] == round(tcli["median_tokens_per_s"] / 200.0, 2)
    assert report["joeynmt"] == "joeynmt 2.3.0 torch fake"
    assert report["command"].startswith("python scripts/bench_joeynmt.py --joey-python")
    # the text JoeyNMT trains on is the corpus itself
    assert (tmp_path / "work" / "text" / "train.de").read_text(encoding="utf-8").count("\n") == 29000
