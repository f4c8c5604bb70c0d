"""Result rows of one tuning experiment (docs/results_<name>.json), read from what its commands wrote.

    /usr/bin/time -v -o R.time tcli train --config C --run-dir R --set ... > R.out 2> R.err
    tcli average --run-dir R --last 5
    tcli eval --run-dir R --split valid|test --checkpoint best|averaged --beam 5 --quiet --json  # into EVAL_LOG
    python scripts/experiment_rows.py --run-dir R --train-out R.out --time R.time --eval-log EVAL_LOG > docs/results_X.json

A training stopped and continued with `--resume` gives one `/usr/bin/time -v` report per part:
pass them all (`--time R.time R.time2`, in order); the rows take the first part's command, the
largest peak RSS, and the training minutes summed over the parts from the last part's summary.
If the first part's report was lost (a killed `/usr/bin/time` writes none), pass the reports there
are, the first of them a `--resume` one, with `--note` saying so: the rows give the command without
`--resume` and the peak of the timed parts only, and carry the note.

EVAL_LOG holds each eval's JSON object preceded by a line `# <the eval command>`, as the shell loops
in docs/benchmarks.md write it. One row per test-set checkpoint, with that checkpoint's validation
lc BLEU beside it; an experiment is not part of the report (docs/results.json). `hardware` is this
machine's, so run it where the experiment ran.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import hardware, metrics_summary  # noqa: E402


def fail(message: str):
    sys.exit(f"experiment_rows: {message}")


def eval_results(path: Path) -> list[tuple[str, dict]]:
    """(command, result) for each `# command` line followed by a JSON object in an eval log."""
    text = path.read_text(encoding="utf-8")
    found, decoder = [], json.JSONDecoder()
    for match in re.finditer(r"^# (.+)\n", text, flags=re.M):
        try:
            result, _ = decoder.raw_decode(text, match.end())
        except ValueError:
            fail(f"{path}: no JSON object after the command `{match.group(1)}`")
        found.append((match.group(1), result))
    if not found:
        fail(f"{path}: no `# command` line followed by an eval result")
    return found


def timed(path: Path) -> tuple[list[str], float]:
    """The command and peak RSS (MB) from a `/usr/bin/time -v` report."""
    fields = dict(line.strip().split(": ", 1) for line in path.read_text().splitlines() if ": " in line)
    try:
        command = shlex.split(fields["Command being timed"].strip('"'))
        return command, round(int(fields["Maximum resident set size (kbytes)"]) / 1024)
    except (KeyError, ValueError) as e:
        fail(f"{path}: not a /usr/bin/time -v report ({e})")


def _python(word: str) -> str:
    """`python` for any interpreter path, so the rows' commands do not name this machine's."""
    return "python" if Path(word).name.startswith("python") else word


def timed_parts(paths: list[Path], note: str | None) -> tuple[list[str], float]:
    """The first part's command and the largest peak RSS of a training run in one or more parts."""
    parts = [([_python(w) for w in command], peak) for command, peak in map(timed, paths)]
    first = parts[0][0]
    if "--resume" in first:
        if not note:
            fail(f"{paths[0]}: a --resume part, so the first part is untimed; pass --note saying why")
        first = [w for w in first if w != "--resume"]
    for path, (command, _) in zip(paths[1:], parts[1:]):
        if [w for w in command if w != "--resume"] != first or "--resume" not in command:
            fail(f"{path}: not `{shlex.join(first)}` continued with --resume")
    return first, max(peak for _, peak in parts)


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def averaged_last(run_dir: Path, valid_steps: list[int]) -> int:
    """N of the `tcli average --last N` that wrote checkpoints/averaged: its sources must be the last N
    validated steps (the periodic checkpoints), else the command in the rows would be wrong."""
    sources = json.loads((run_dir / "checkpoints" / "averaged" / "info.json").read_text())["averaged"]
    steps = sorted(int(name.removeprefix("step_")) for name in sources)
    if not steps or steps != sorted(valid_steps)[-len(steps):]:
        fail(f"{run_dir}/checkpoints/averaged holds {', '.join(sources)}, not the last {len(sources)} "
             "validated steps; these rows only describe `tcli average --last N`")
    return len(steps)


def rows(run_dir: Path, train_out: Path, time_files: list[Path], eval_log: Path,
         note: str | None = None) -> list[dict]:
    from transformer_cli.config import load_config
    from transformer_cli.plots import read_metrics

    cfg = load_config(run_dir / "config.yaml")
    summary = json.loads(train_out.read_text().strip().splitlines()[-1])
    valid = [m for m in read_metrics(run_dir) if "valid_bleu" in m]
    train_cmd, peak_mb = timed_parts(time_files, note)
    overrides = [train_cmd[i + 1] for i, w in enumerate(train_cmd[:-1]) if w == "--set"]
    results = eval_results(eval_log)
    valid_lc = {Path(r["checkpoint"]).parent.name: r["bleu_lc"] for _, r in results if r["split"] == "valid"}
    out = []
    for command, r in results:
        if r["split"] != "test":
            continue
        name = label = Path(r["checkpoint"]).parent.name
        steps = [shlex.join(train_cmd)]
        if name == "averaged":
            n = averaged_last(run_dir, [m["step"] for m in valid])
            label = f"averaged ({n} ckpts)"
            steps.append(f"python -m transformer_cli average --run-dir {run_dir} --last {n}")
        steps.append(command)
        out.append({
            "direction": f"{cfg.data.src_lang}-{cfg.data.tgt_lang}", "test_set": cfg.data.test_split,
            "checkpoint": label, "bleu": round(r["bleu"], 2), "bleu_lc": round(r["bleu_lc"], 2),
            "chrf": round(r["chrf"], 2), "beam": r["beam"], "alpha": r["alpha"],
            "valid_bleu_lc": round(valid_lc[name], 2) if name in valid_lc else None,
            "train_minutes": round(summary["wall_s"] / 60, 1), "steps": summary["step"], "epochs": summary["epoch"],
            "stopped": summary["stopped"], "final_valid_bleu_greedy": valid[-1]["valid_bleu"] if valid else None,
            "best_valid_bleu_greedy": summary.get("best_score"), "best_step": summary.get("best_step"),
            "median_tgt_tokens_per_s": metrics_summary(run_dir)["train_tgt_tokens_per_s"],
            "train_peak_rss_mb": peak_mb, "hardware": hardware(), "train_threads": cfg.train.threads,
            "config": option(train_cmd, "--config"), "overrides": overrides, "command": "; ".join(steps),
            "bleu_signature": r["bleu_signature"], "bleu_lc_signature": r["bleu_lc_signature"],
        } | ({"note": note} if note else {}))
    if not out:
        fail(f"{eval_log}: no test-split result")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--train-out", type=Path, required=True, help="the training's stdout (its JSON summary)")
    ap.add_argument("--time", type=Path, nargs="+", required=True,
                    help="the training's /usr/bin/time -v report (one per part of a resumed training, in order)")
    ap.add_argument("--eval-log", type=Path, required=True)
    ap.add_argument("--note", help="added to every row: what the files cannot say (e.g. a lost time report)")
    a = ap.parse_args()
    for path in (a.run_dir / "config.yaml", a.run_dir / "metrics.jsonl", a.train_out, *a.time, a.eval_log):
        if not path.exists():
            fail(f"{path} does not exist")
    from transformer_cli.errors import DataError

    try:
        print(json.dumps(rows(a.run_dir, a.train_out, a.time, a.eval_log, a.note), indent=1))
    except DataError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
