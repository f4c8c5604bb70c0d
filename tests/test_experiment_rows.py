"""scripts/experiment_rows.py: a tuning experiment's rows, read from the files its commands wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from .conftest import ROOT

TRAIN = ("python -m transformer_cli train --config configs/multi30k_de_en.yaml --run-dir R "
         "--set model.word_dropout=0.1 --set train.threads=2")


AVERAGED = ["step_00000150", "step_00000050", "step_00000100"]  # as tcli average --last 3 lists them


def _eval(split, ckpt, bleu_lc):
    command = f"python -m transformer_cli eval --run-dir R --split {split} --checkpoint {ckpt} --beam 5 --json"
    result = {"split": split, "checkpoint": f"R/checkpoints/{ckpt}/model.safetensors", "bleu": bleu_lc - 0.3,
              "bleu_lc": bleu_lc, "chrf": 60.0 + bleu_lc / 100, "beam": 5, "alpha": 0.6,
              "bleu_signature": "case:mixed", "bleu_lc_signature": "case:lc"}
    return f"# {command}\n{json.dumps(result, indent=2)}\n"


def _time_report(path, command, kbytes):
    path.write_text(f'\tCommand being timed: "/usr/bin/python3.11 {command[7:]}"\n'
                    f"\tMaximum resident set size (kbytes): {kbytes}\n")


def _experiment(tmp_path):
    run = tmp_path / "R"
    (run / "checkpoints" / "averaged").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "multi30k_de_en.yaml", run / "config.yaml")
    (run / "checkpoints" / "averaged" / "info.json").write_text(json.dumps({"averaged": AVERAGED}))
    metrics = [{"step": 50, "tokens_per_s": 100.0}, {"step": 50, "valid_bleu": 25.0},
               {"step": 100, "tokens_per_s": 300.0}, {"step": 100, "valid_bleu": 30.5},
               {"step": 150, "tokens_per_s": 200.0}, {"step": 150, "valid_bleu": 31.25}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (tmp_path / "R.out").write_text(json.dumps({"stopped": "max_steps", "step": 150, "epoch": 2, "best_score": 31.5,
                                                "best_step": 100, "wall_s": 600.0}) + "\n")
    _time_report(tmp_path / "R.time", TRAIN, 2097152)
    log = "averaged 3 checkpoints into R/checkpoints/averaged\n" + "".join(
        _eval(s, c, v) for s, c, v in [("valid", "best", 43.0), ("valid", "averaged", 43.5),
                                       ("test", "best", 41.0), ("test", "averaged", 41.75)])
    (tmp_path / "eval.log").write_text(log)
    return run


def _rows(tmp_path, run, times=("R.time",), extra=()):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "experiment_rows.py"), "--run-dir", str(run),
                           "--train-out", str(tmp_path / "R.out"), "--time", *[str(tmp_path / t) for t in times],
                           "--eval-log", str(tmp_path / "eval.log"), *extra], capture_output=True, text=True, cwd=ROOT)


def test_rows_pair_each_test_result_with_its_validation_score(tmp_path):
    result = _rows(tmp_path, _experiment(tmp_path))
    assert result.returncode == 0, result.stderr
    best, averaged = json.loads(result.stdout)
    assert (best["checkpoint"], averaged["checkpoint"]) == ("best", "averaged (3 ckpts)")
    assert (best["bleu_lc"], best["valid_bleu_lc"]) == (41.0, 43.0)
    assert (averaged["bleu_lc"], averaged["valid_bleu_lc"], averaged["bleu"]) == (41.75, 43.5, 41.45)
    assert averaged["median_tgt_tokens_per_s"] == 200 and averaged["train_peak_rss_mb"] == 2048
    assert (averaged["final_valid_bleu_greedy"], averaged["best_valid_bleu_greedy"]) == (31.25, 31.5)
    assert (averaged["train_minutes"], averaged["steps"], averaged["stopped"]) == (10.0, 150, "max_steps")
    assert averaged["overrides"] == ["model.word_dropout=0.1", "train.threads=2"]
    assert averaged["config"] == "configs/multi30k_de_en.yaml" and averaged["direction"] == "de-en"
    assert best["command"].startswith(TRAIN + "; python -m transformer_cli eval") and "average" not in best["command"]
    assert averaged["command"].split("; ")[1] == "python -m transformer_cli average --run-dir " + str(
        tmp_path / "R") + " --last 3"


def test_an_eval_log_without_results_is_one_line_error(tmp_path):
    run = _experiment(tmp_path)
    (tmp_path / "eval.log").write_text("# python -m transformer_cli eval --split test\nTraceback: killed\n")
    result = _rows(tmp_path, run)
    assert result.returncode != 0 and "Traceback (most recent" not in result.stderr
    assert result.stderr.strip().endswith("no JSON object after the command `python -m transformer_cli eval --split test`")


def test_an_average_that_is_not_the_last_n_is_refused(tmp_path):
    """Rows say `tcli average --last N`; an averaged checkpoint from other steps (--best N) must not pass as one."""
    run = _experiment(tmp_path)
    (run / "checkpoints" / "averaged" / "info.json").write_text(json.dumps({"averaged": ["step_00000050", "step_00000150"]}))
    result = _rows(tmp_path, run)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "not the last 2 validated steps" in result.stderr


def test_a_resumed_training_takes_the_first_command_and_the_largest_peak(tmp_path):
    run = _experiment(tmp_path)
    _time_report(tmp_path / "R.time", TRAIN, 1048576)
    _time_report(tmp_path / "R.time2", TRAIN + " --resume", 3145728)
    result = _rows(tmp_path, run, ("R.time", "R.time2"))
    assert result.returncode == 0, result.stderr
    for row in json.loads(result.stdout):
        assert row["train_peak_rss_mb"] == 3072 and row["command"].startswith(TRAIN + "; ")
        assert row["overrides"] == ["model.word_dropout=0.1", "train.threads=2"]


def test_a_second_part_that_is_another_command_is_refused(tmp_path):
    run = _experiment(tmp_path)
    _time_report(tmp_path / "R.time2", TRAIN.replace("threads=2", "threads=1") + " --resume", 3145728)
    result = _rows(tmp_path, run, ("R.time", "R.time2"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "R.time2: not `python -m transformer_cli train" in result.stderr
    _time_report(tmp_path / "R.time2", TRAIN, 3145728)  # the same command again, not a resume
    assert _rows(tmp_path, run, ("R.time", "R.time2")).returncode != 0


def test_a_lost_first_report_needs_a_note_and_gives_the_command_without_resume(tmp_path):
    run = _experiment(tmp_path)
    _time_report(tmp_path / "R.time2", TRAIN + " --resume", 3145728)
    refused = _rows(tmp_path, run, ("R.time2",))
    assert refused.returncode != 0 and "Traceback" not in refused.stderr and "pass --note" in refused.stderr
    result = _rows(tmp_path, run, ("R.time2",), ("--note", "first part untimed"))
    assert result.returncode == 0, result.stderr
    for row in json.loads(result.stdout):
        assert row["command"].startswith(TRAIN + "; ") and "--resume" not in row["command"]
        assert (row["note"], row["train_peak_rss_mb"]) == ("first part untimed", 3072)
    assert "note" not in json.loads(_rows(tmp_path, run).stdout)[0]
