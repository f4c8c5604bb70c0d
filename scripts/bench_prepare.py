"""Benchmark `tcli prepare`: wall time and peak memory from scratch, then the cached second run.

Each run is a fresh `python -m transformer_cli prepare` process (so imports are counted); its peak
resident memory comes from os.wait4. Medians over --repeat runs.

    python scripts/bench_prepare.py --config configs/multi30k_de_en_base.yaml --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str]) -> tuple[float, float, float, str]:
    """(wall s, CPU s, peak RSS MiB, stderr) of one tcli process."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "transformer_cli", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"tcli {' '.join(args)} failed:\n{stderr}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, stderr


def bench_batching(run_dir: Path, max_tokens: int) -> str:
    """Time one epoch of batch planning and collation on the prepared train split (in this process)."""
    import numpy as np

    from transformer_cli.batching import collate, split_batches
    from transformer_cli.data import load_split

    t0 = time.perf_counter()
    split = load_split(run_dir, "train")
    load = time.perf_counter() - t0
    plans, collates, batches = [], [], []
    for epoch in range(5):
        t0 = time.perf_counter()
        batches = split_batches(split, max_tokens, seed=1, epoch=epoch)
        plans.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b in batches:
            collate(split, b)
        collates.append(time.perf_counter() - t0)
    src, tgt = split.src_lens + 1, split.tgt_lens + 1
    pad_src = 1 - src.sum() / sum(len(b) * src[b].max() for b in batches)
    pad_tgt = 1 - tgt.sum() / sum(len(b) * tgt[b].max() for b in batches)
    return (f"batching (max_tokens {max_tokens}): load_split {load * 1e3:.0f} ms, plan an epoch "
            f"{statistics.median(plans) * 1e3:.1f} ms, collate an epoch ({len(batches)} batches) "
            f"{statistics.median(collates) * 1e3:.0f} ms = {statistics.median(collates) / len(batches) * 1e3:.2f} ms/batch, "
            f"padding src {pad_src:.1%} tgt {pad_tgt:.1%}")


def bench_large_batching(n: int = 2_000_000, max_tokens: int = 4096) -> str:
    """Batch planning and collation on a synthetic WMT-sized split (random lengths 1-59): per-batch cost must not grow with n."""
    import numpy as np

    from transformer_cli.batching import collate, token_batches
    from transformer_cli.data import EncodedSplit, Ragged

    rng = np.random.default_rng(0)

    def ragged(lengths):
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Ragged(rng.integers(4, 8000, offsets[-1]).astype(np.int32), offsets)

    src_lens, tgt_lens = rng.integers(1, 60, n), rng.integers(1, 60, n)
    split = EncodedSplit(ragged(src_lens), ragged(tgt_lens), _text={"src": [], "tgt": []})
    t0 = time.perf_counter()
    batches = token_batches(src_lens + 1, tgt_lens + 1, max_tokens, seed=1, epoch=0)
    plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in batches[:500]:
        collate(split, b)
    per_batch = (time.perf_counter() - t0) / 500
    return (f"synthetic {n:,} pairs: plan an epoch ({len(batches):,} batches) {plan:.2f} s, "
            f"collate {per_batch * 1e3:.2f} ms/batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/multi30k_de_en_base.yaml")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    sys.path.insert(0, str(ROOT))
    args = parser.parse_args()
    sets = [w for s in args.sets for w in ("--set", s)]
    scratch, cached, run_dirs = [], [], []
    try:
        for _ in range(args.repeat):
            run_dirs.append(Path(tempfile.mkdtemp(prefix="bench_prepare_")))
            cmd = ["prepare", "--config", args.config, "--run-dir", str(run_dirs[-1]), *sets]
            scratch.append(run(cmd))
            cached.append(run(cmd))
            assert "nothing to do" in cached[-1][3]
        # After the timed processes: importing torch here would inflate the children's peak RSS.
        batching = bench_batching(run_dirs[-1], 4096)
    finally:
        for run_dir in run_dirs:
            shutil.rmtree(run_dir)
    tok = [line for line in scratch[-1][3].splitlines() if "tokenizer in" in line]
    print(f"command: tcli prepare --config {args.config} {' '.join(sets)} (fresh run dir), {args.repeat} runs, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for name, rows in (("from scratch", scratch), ("cached", cached)):
        print(f"{name:13s} wall {statistics.median(r[0] for r in rows):6.2f} s  "
              f"cpu {statistics.median(r[1] for r in rows):6.2f} s  "
              f"peak RSS {statistics.median(r[2] for r in rows):6.0f} MiB  "
              f"(walls: {', '.join(f'{r[0]:.2f}' for r in rows)})")
    if tok:
        print(f"last run: {tok[0].removeprefix('prepare: ')}")
    print(batching)
    print(bench_large_batching())


if __name__ == "__main__":
    main()
