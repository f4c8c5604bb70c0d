"""scripts/benchmark.sh end to end in quick mode on a tiny Multi30k slice, and its helpers.

The results.json figures are checked against sacreBLEU recomputed here from the hypothesis files
the pipeline wrote, and against the run's metrics.jsonl: nothing is compared with typed-in numbers.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_cli.metrics import score_files
from transformer_cli.plots import read_metrics

from .conftest import ROOT

spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts" / "benchmark.py")
benchmark = importlib.util.module_from_spec(spec)
spec.loader.exec_module(benchmark)

TEST_LINES = 16
# configs/smoke.yaml made smaller still: 20 updates, a checkpoint every 10 (2 to average)
TINY_CONFIG = """\
run_dir: runs/unused
data: {{path: {data}, download: false, src_lang: de, tgt_lang: en, max_len: 64}}
tokenizer: {{model_type: bpe, vocab_size: 400}}
model: {{d_model: 32, num_heads: 2, ff_size: 64, encoder_layers: 1, decoder_layers: 1, norm: pre}}
train: {{max_tokens: 1024, lr: 3e-3, warmup_steps: 5, max_steps: 20, valid_every: 10, log_every: 5,
        threads: 1, keep_last: 3, keep_best: 2}}
decode: {{max_len_a: 1.2, max_len_b: 3}}
"""


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "benchmark.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, multi30k):
    """One quick-mode pipeline run on 500/20/16 Multi30k de-en pairs; returns its folders."""
    root = tmp_path_factory.mktemp("bench")
    data = root / "data"
    data.mkdir()
    for split, count in (("train", 500), ("val", 20), ("test_2016_flickr", TEST_LINES)):
        for lang in ("de", "en"):
            with gzip.open(multi30k / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [next(f) for _ in range(count)]
            (data / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG.format(data=data), encoding="utf-8")
    out, runs = root / "out", root / "runs"
    result = run_benchmark("--quick", "--configs", str(config), "--runs", str(runs), "--out", str(out),
                           "--no-speed", "--set", "train.max_steps=20", "--set", "train.valid_every=10")
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "data": data, "config": config, "out": out, "run": runs / "tiny", "stderr": result.stderr,
            "runs": runs}


def test_results_json_holds_the_measured_scores(pipeline):
    results = json.loads((pipeline["out"] / "results.json").read_text())
    assert [r["checkpoint"] for r in results] == ["best", "averaged"]
    run = pipeline["run"]
    ref = run / "hyps" / "test.ref.txt"
    # the pipeline scored against the test references of the config's data
    assert ref.read_text(encoding="utf-8") == (pipeline["data"] / "test_2016_flickr.en").read_text(encoding="utf-8")
    metrics = read_metrics(run)
    for r in results:
        for key in benchmark.REQUIRED:
            assert r[key] not in (None, ""), key
        assert r["direction"] == "de-en" and r["test_set"] == "test_2016_flickr" and r["mode"] == "quick"
        assert r["beam"] == 5 and r["num_sentences"] == TEST_LINES
        again = score_files(run / "hyps" / f"test.{r['checkpoint']}.txt", ref)
        for key in ("bleu", "bleu_lc", "chrf"):
            assert r[key] == round(again[key], 2)
            assert r[f"{key}_signature"] == again[f"{key}_signature"]
        assert r["train_minutes"] == round(max(m["wall_s"] for m in metrics) / 60, 2)
        assert r["train_steps"] == 20 and r["train_peak_rss_mb"] > 50 and r["train_threads"] == 1
        assert r["hardware"].startswith(("cpu: ", "gpu: "))
        words = shlex.split(r["command"])
        assert words[-2:] == ["--set", "train.valid_every=10"]  # the overrides, in the order given
        assert "train" in words and words[words.index("--config") + 1] == str(pipeline["config"])
        assert "--resume" not in words and "--overwrite" not in words
        assert f"--checkpoint {r['checkpoint']}" in r["eval_command"] and "--beam 5" in r["eval_command"]
    averaged = results[1]["averaged"]
    assert averaged == ["step_00000010", "step_00000020"]


def test_report_section_pngs_and_other_sections_kept(pipeline):
    out = pipeline["out"]
    doc = (out / "benchmarks.md").read_text(encoding="utf-8")
    original = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    results = json.loads((out / "results.json").read_text())
    quality = doc.split("\n## Quality\n", 1)[1].split("\n## ", 1)[0]
    assert "QUICK-MODE SMOKE FIGURES" in quality
    for r in results:
        assert f"| {r['direction']} | {r['checkpoint']}" in quality
        # tcli eval scored the tokenized lowercased BLEU too, so the table has that column
        assert f"| {r['bleu']:.2f} | {r['bleu_lc']:.2f} | {r['bleu_tok_lc']:.2f} | {r['chrf']:.2f} | 5 |" in quality
        assert r["bleu_tok_lc_signature"] in quality
    for line in original.splitlines():  # every other section survives word for word
        if line.startswith("## ") and line != "## Quality":
            section = original.split(line + "\n", 1)[1].split("\n## ", 1)[0]
            assert section in doc
    for png in ("training_tiny.png", "attention_tiny.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in quality


def test_readme_results_block_comes_from_results_json(pipeline):
    out = pipeline["out"]
    readme = (out / "README.md").read_text(encoding="utf-8")
    original = (ROOT / "README.md").read_text(encoding="utf-8")
    results = json.loads((out / "results.json").read_text())
    block = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    assert benchmark.BEGIN in block and "QUICK-MODE SMOKE FIGURES" in block and "Not measured yet" not in block
    for r in results:
        assert f"| {r['direction']} | {r['checkpoint']}" in block
        assert (f"| {r['bleu']:.2f} | {r['bleu_lc']:.2f} | {r['bleu_tok_lc']:.2f} | {r['chrf']:.2f} | 5 | "
                f"{r['train_minutes']:.1f} |") in block
    assert "](results.json)" in block and "](training_tiny.png)" in block and "](attention_tiny.png)" in block
    assert readme.split("\n## Results\n", 1)[0] == original.split("\n## Results\n", 1)[0]  # the rest kept
    assert readme.split(benchmark.END, 1)[1] == original.split(benchmark.END, 1)[1]


def test_rerun_skips_finished_runs(pipeline):
    before = (pipeline["run"] / "bench" / "train.measure.json").read_text()
    results = (pipeline["out"] / "results.json").read_text()
    (pipeline["out"] / "training_tiny.png").unlink()  # as when the run was measured with another --out
    again = run_benchmark("--quick", "--configs", str(pipeline["config"]), "--runs", str(pipeline["runs"]),
                          "--out", str(pipeline["out"]), "--no-speed")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "tiny: skipped" in again.stderr
    assert (pipeline["run"] / "bench" / "train.measure.json").read_text() == before
    assert (pipeline["out"] / "results.json").read_text() == results
    assert (pipeline["out"] / "training_tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn again


def test_a_tcli_on_path_from_another_checkout_is_not_used(pipeline, tmp_path):
    """An installed tcli whose package lies elsewhere would measure other code: python -m runs instead."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "tcli"
    fake.write_text('#!/bin/sh\nif [ "$1" = info ]; then echo "package /elsewhere/transformer_cli"; exit 0; fi\n'
                    'echo "fake tcli ran: $*" >&2; exit 3\n', encoding="utf-8")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    again = subprocess.run(["bash", str(ROOT / "scripts" / "benchmark.sh"), "--quick", "--configs",
                            str(pipeline["config"]), "--runs", str(pipeline["runs"]), "--out", str(tmp_path / "out"),
                            "--no-speed"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "runs another copy of the code" in again.stderr and "fake tcli ran" not in again.stderr
    assert (tmp_path / "out" / "training_tiny.png").is_file()  # plotted by this checkout's code


def test_jobs_runs_configs_side_by_side_and_reports_each_failure(pipeline, tmp_path):
    """--jobs 2: a new config trains in the background next to a finished one; a bad one fails alone."""
    second = tmp_path / "tiny_b.yaml"
    second.write_text(pipeline["config"].read_text().replace("threads: 1,", "threads: 1, seed: 7,"), encoding="utf-8")
    out = tmp_path / "out"
    ok = run_benchmark("--quick", "--jobs", "2", "--configs", f"{pipeline['config']} {second}",
                       "--runs", str(pipeline["runs"]), "--out", str(out), "--no-speed")
    assert ok.returncode == 0, ok.stderr[-3000:]
    new_run = pipeline["runs"] / "tiny_b"
    assert (new_run / "bench" / "exit").read_text().strip() == "0"
    assert "tiny_b: done" in (new_run / "bench" / "log").read_text()  # its progress went to its own log
    assert "tiny_b: done" in ok.stderr and "tiny: skipped" in (pipeline["run"] / "bench" / "log").read_text()
    rows = json.loads((out / "results.json").read_text())
    assert [(Path(r["run_dir"]).name, r["checkpoint"]) for r in rows] == [
        ("tiny", "best"), ("tiny", "averaged"), ("tiny_b", "best"), ("tiny_b", "averaged")]
    assert (out / "training_tiny_b.png").is_file()

    bad = tmp_path / "tiny_bad.yaml"
    bad.write_text(pipeline["config"].read_text().replace("d_model: 32", "d_model: 33"), encoding="utf-8")
    failed = run_benchmark("--quick", "--jobs", "2", "--configs", f"{second} {bad}",
                           "--runs", str(pipeline["runs"]), "--out", str(tmp_path / "out2"), "--no-speed")
    assert failed.returncode == 1
    assert "tiny_bad: failed (exit 2)" in failed.stderr and "must divide" in failed.stderr  # the log's tail
    assert "tiny_b: done" in failed.stderr and not (tmp_path / "out2" / "results.json").exists()
    log = (new_run / "bench" / "log").read_text()
    assert "tiny_b: trained" in log and "tiny_b: skipped" in log  # the rerun appended to the training's log


def test_replace_section_is_idempotent_and_keeps_hand_text():
    doc = "# B\n\n## A\ntext a\n\n## Quality\n\nhand-written intro\n\n## C\ntext c\n"
    once = benchmark.replace_section(doc, "## Quality", f"{benchmark.BEGIN}\nv1\n{benchmark.END}\n")
    twice = benchmark.replace_section(once, "## Quality", f"{benchmark.BEGIN}\nv2\n{benchmark.END}\n")
    assert "hand-written intro" in twice and "v1" not in twice and "v2" in twice
    assert twice.startswith("# B\n\n## A\ntext a\n\n## Quality\n") and twice.endswith("\n## C\ntext c\n")
    assert benchmark.replace_section(twice, "## Quality", f"{benchmark.BEGIN}\nv2\n{benchmark.END}\n") == twice
    appended = benchmark.replace_section("# B\n", "## Quality", "body\n")
    assert appended == "# B\n\n## Quality\n\nbody\n"


def test_measure_passes_exit_code_and_reports_peak_memory(tmp_path):
    out = tmp_path / "m.json"
    code = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); raise SystemExit(3)"
    assert benchmark.measure(out, ["--", sys.executable, "-c", code]) == 3
    m = json.loads(out.read_text())
    assert m["exit_code"] == 3 and m["peak_rss_mb"] >= 300 and m["command"][-1] == code


def test_check_record_names_missing_keys():
    rec = {k: 1 for k in benchmark.REQUIRED}
    benchmark.check_record(rec)
    del rec["bleu_lc"]
    with pytest.raises(ValueError, match="bleu_lc"):
        benchmark.check_record(rec)


def test_report_keeps_earlier_runs_and_replaces_redone_ones(pipeline, tmp_path):
    """A second invocation on another run dir adds its results; redoing a run replaces its results."""
    real = json.loads((pipeline["run"] / "bench" / "result.json").read_text())
    other = tmp_path / "other"
    (other / "bench").mkdir(parents=True)
    moved = [{**r, "run_dir": str(other), "direction": "en-de", "bleu": r["bleu"] + 1} for r in real]
    (other / "bench" / "result.json").write_text(json.dumps(moved))
    results, doc = tmp_path / "results.json", tmp_path / "b.md"
    benchmark.report([pipeline["run"]], results, doc, None, [])
    benchmark.report([other], results, doc, None, [])
    assert json.loads(results.read_text()) == real + moved
    benchmark.report([pipeline["run"]], results, doc, None, [])  # redone: its old rows are replaced
    assert json.loads(results.read_text()) == moved + real
    assert doc.read_text().count("| en-de | best |") == 2  # quality and per-run tables


def test_rows_from_before_the_tokenized_score_show_a_dash_and_alone_keep_the_old_columns(pipeline):
    """results.json rows written before tcli eval scored BLEU (tok lc) have no such key: '-' in that column
    beside newer rows, and a table of old rows only has no such column."""
    real = json.loads((pipeline["run"] / "bench" / "result.json").read_text())
    old = [{k: v for k, v in r.items() if not k.startswith("bleu_tok_lc")} for r in real]
    mixed = "\n".join(benchmark.quality_table(old + real))
    assert "| BLEU (tok lc) |" in mixed
    assert f"| {old[0]['bleu']:.2f} | {old[0]['bleu_lc']:.2f} | - | {old[0]['chrf']:.2f} |" in mixed
    assert f"| {real[0]['bleu_lc']:.2f} | {real[0]['bleu_tok_lc']:.2f} | {real[0]['chrf']:.2f} |" in mixed
    alone = benchmark.quality_table(old)
    assert "tok lc" not in alone[0] and alone[1].count("---") == alone[0].count("|") - 1


def test_report_on_some_configs_still_links_earlier_configs_figures(pipeline, tmp_path):
    """Rerunning the report for one config keeps the links to the training curves and heatmaps of the configs
    measured before (the PNGs are in the results folder): curves after the given curves, heatmaps last."""
    real = json.loads((pipeline["run"] / "bench" / "result.json").read_text())
    other = tmp_path / "other"
    (other / "bench").mkdir(parents=True)
    moved = [{**r, "run_dir": str(other), "config": "configs/other_cfg.yaml"} for r in real]
    (other / "bench" / "result.json").write_text(json.dumps(moved))
    results, doc, readme = tmp_path / "results.json", tmp_path / "b.md", tmp_path / "README.md"
    figures = [str(tmp_path / "training_tiny.png"), str(tmp_path / "attention_tiny.png")]
    benchmark.report([other], results, doc, None, [], readme)
    benchmark.report([pipeline["run"]], results, doc, None, figures, readme)
    assert "other_cfg.png" not in readme.read_text()  # no PNG, no link
    (tmp_path / "training_other_cfg.png").write_bytes(b"png")
    benchmark.report([pipeline["run"]], results, doc, None, figures, readme)
    line = next(x for x in readme.read_text().splitlines() if x.startswith("Figures: "))
    assert line == ("Figures: [training_tiny](training_tiny.png), [training_other_cfg](training_other_cfg.png), "
                    "[attention_tiny](attention_tiny.png)")
    assert "- [training_other_cfg](training_other_cfg.png)" in doc.read_text()
    (tmp_path / "attention_other_cfg.png").write_bytes(b"png")
    benchmark.report([pipeline["run"]], results, doc, None, figures, readme)
    line = next(x for x in readme.read_text().splitlines() if x.startswith("Figures: "))
    assert line.endswith("[attention_tiny](attention_tiny.png), [attention_other_cfg](attention_other_cfg.png)")
    assert line.count("attention_other_cfg.png") == 1
    assert "- [attention_other_cfg](attention_other_cfg.png)" in doc.read_text()


def test_decode_rows_reads_bench_decode_lines_and_tables(tmp_path):
    """bench_decode.py prints no JSON: its 'beam B LABEL: S sent/s T tok/s' lines and tables are read."""
    log = tmp_path / "decode.log"
    log.write_text("model: 2+2 layers, d_model 64\n"
                   "beam 1 all         :     1.8 sent/s       72 tok/s  (5.43 s wall)\n"
                   "beam 5 sub-nocache :     0.4 sent/s       15 tok/s  (4.90 s wall)\n\n"
                   "| search | sentences/s |\n|---|---|\n| greedy | 1.8 |\n")
    rows = benchmark.decode_rows(log)
    assert rows["model"] == "2+2 layers, d_model 64"
    assert rows["rows"] == {"beam1 all": {"sentences_per_s": 1.8, "tgt_tokens_per_s": 72.0},
                            "beam5 sub-nocache": {"sentences_per_s": 0.4, "tgt_tokens_per_s": 15.0}}
    assert rows["markdown"] == "| search | sentences/s |\n|---|---|\n| greedy | 1.8 |"
    log.write_text("model: x\nsomething else\n")
    with pytest.raises(SystemExit, match="bench_decode.py change its output"):
        benchmark.decode_rows(log)


def seeds_args(pipeline, out: Path) -> tuple[str, ...]:
    """benchmark.sh arguments for the pipeline's tiny config with a second seed and their ensemble."""
    return ("--quick", "--seeds", "2", "--jobs", "2", "--configs", str(pipeline["config"]),
            "--runs", str(pipeline["runs"]), "--out", str(out), "--no-speed",
            "--set", "train.max_steps=20", "--set", "train.valid_every=10")


def test_seeds_trains_another_seed_and_reports_the_ensemble(pipeline, tmp_path):
    """--seeds 2: the finished run is kept, seed 2 trains beside it, the two decode the test set together."""
    out = tmp_path / "out"
    r = run_benchmark(*seeds_args(pipeline, out))
    assert r.returncode == 0, r.stderr[-3000:]
    seed2 = pipeline["runs"] / "tiny_seed2"
    assert "train.seed=2" in (seed2 / "bench" / "log").read_text()
    assert "seed: 2" in (seed2 / "config.yaml").read_text()
    rows = json.loads((out / "results.json").read_text())
    assert [(Path(x["run_dir"]).name, x["checkpoint"]) for x in rows] == [
        ("tiny", "best"), ("tiny", "averaged"), ("tiny", "averaged.ensemble2"),
        ("tiny_seed2", "best"), ("tiny_seed2", "averaged")]
    single, ens, other = rows[1], rows[2], rows[4]
    hyp = pipeline["run"] / "hyps" / "test.averaged.ensemble2.txt"
    assert ens["bleu"] == round(score_files(hyp, pipeline["run"] / "hyps" / "test.ref.txt")["bleu"], 2)
    assert ens["ensemble"] == [str(pipeline["run"]), str(seed2)] and ens["seed"] == [1, 2]
    assert ens["train_minutes"] == pytest.approx(single["train_minutes"] + other["train_minutes"], abs=0.011)
    assert ens["train_steps"] == single["train_steps"] + other["train_steps"]
    assert ens["train_stopped"] == [single["train_stopped"], other["train_stopped"]] == ["max_steps"] * 2
    assert ens["command"] == f"{single['command']} && {other['command']}" and "train.seed=2" in ens["command"]
    assert f"--ensemble {seed2}" in ens["eval_command"]
    readme = (out / "README.md").read_text()
    assert "| ensemble of 2 x averaged (2 ckpts), seeds 1, 2 |" in readme
    assert "| averaged (2 ckpts), seed 2 |" in readme
    assert not (out / "training_tiny_seed2.png").exists()  # curves of the config's own run only


def test_ensemble_is_decoded_again_when_a_member_changed(pipeline, tmp_path):
    """A rerun reuses the ensemble's decode, unless a member's checkpoint is newer (trained further)."""
    args = seeds_args(pipeline, tmp_path / "out")
    decoding = "decoding the test set with the ensemble of 2 seeds"
    assert run_benchmark(*args).returncode == 0  # trains seed 2 if no earlier test did
    again = run_benchmark(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert decoding not in again.stderr
    member = pipeline["runs"] / "tiny_seed2" / "checkpoints" / "averaged" / "model.safetensors"
    decoded = pipeline["run"] / "bench" / "eval.averaged.ensemble2.json"
    before = decoded.stat().st_mtime
    os.utime(member, (before + 60, before + 60))  # as a --resume that took seed 2 further would leave it
    redo = run_benchmark(*args)
    assert redo.returncode == 0, redo.stderr[-3000:]
    assert decoding in redo.stderr
    assert decoded.stat().st_mtime > before


def test_record_of_a_run_with_a_bad_config_is_one_line_not_a_traceback(tmp_path):
    run = tmp_path / "run"
    (run / "bench").mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  no_such_key: 1\n", encoding="utf-8")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "record", "--run-dir", str(run),
                          "--config", "configs/multi30k_de_en.yaml", "--mode", "full"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"benchmark: error: {run / 'config.yaml'}: unknown key 'data.no_such_key'")


def test_a_run_with_ema_also_reports_the_ema_checkpoint(pipeline, tmp_path):
    """train.ema_decay > 0 writes checkpoints/ema; the pipeline decodes it too and reports its row."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    result = run_benchmark("--quick", "--configs", str(pipeline["config"]), "--runs", str(runs), "--out", str(out),
                           "--no-speed", "--set", "train.max_steps=20", "--set", "train.valid_every=10",
                           "--set", "train.ema_decay=0.9")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [r["checkpoint"] for r in rows] == ["best", "averaged", "ema"]
    ema = rows[2]
    assert ema["bleu"] == json.loads((runs / "tiny" / "bench" / "eval.ema.json").read_text())["bleu"]
    assert (runs / "tiny" / "hyps" / "test.ema.txt").is_file()
    assert "| ema |" in (out / "README.md").read_text()


def test_a_run_with_cosine_cycles_reports_its_snapshot_ensemble(pipeline, tmp_path):
    """train.cycles=2 keeps cycle_1 and cycle_2; the pipeline decodes them as an ensemble whose row counts the
    one training once and whose hypotheses score as the row says."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    result = run_benchmark("--quick", "--configs", str(pipeline["config"]), "--runs", str(runs), "--out", str(out),
                           "--no-speed", "--set", "train.max_steps=20", "--set", "train.valid_every=10",
                           "--set", "train.schedule=cosine", "--set", "train.cycles=2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [r["checkpoint"] for r in rows] == ["best", "averaged", "cycle_2.ensemble2"]
    snap, run = rows[2], runs / "tiny"
    assert snap["ensemble"] == [str(run)] and snap["seed"] == [1] and snap["train_steps"] == 20
    assert snap["ensemble_checkpoints"] == [str(run / "checkpoints" / n / "model.safetensors") for n in ("cycle_2", "cycle_1")]
    hyp = run / "hyps" / "test.cycle_2.ensemble2.txt"
    assert snap["bleu"] == round(score_files(hyp, run / "hyps" / "test.ref.txt")["bleu"], 2)
    assert "| ensemble of its 2 cycle snapshots |" in (out / "README.md").read_text()
