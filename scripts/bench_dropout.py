"""Dropout on CPU: tcli's bit-sliced `model.Dropout` vs `torch.nn.functional.dropout`, forward + backward.

Shapes are those of a 4,096-token training batch of the benchmark config (d_model 256), in fp32
and bf16 (the dtype the residual branches have under bf16 autocast). Variants alternate in each
repeat; medians of the per-call times and of the per-repeat ratios.

    python scripts/bench_dropout.py --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_cli.model import Dropout  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--p", type=float, default=0.3)
    ap.add_argument("--shape", default="128,32,256", help="B,T,d_model (4,096 positions by default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    ours = Dropout(args.p).train()
    print(f"shape {shape}, p {args.p}, {args.threads} threads, torch {torch.__version__}, {args.repeats} repeats")
    print(f"{'dtype':<9} {'F.dropout ms':>12} {'tcli ms':>8} {'speed-up':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        ref = lambda: F.dropout(x, args.p, True).backward(grad)  # noqa: E731
        new = lambda: ours(x).backward(grad)  # noqa: E731
        ref(), new()  # warm-up
        a, b = [], []
        for _ in range(args.repeats):
            a.append(timed(ref))
            b.append(timed(new))
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(f"{str(dtype).removeprefix('torch.'):<9} {1e3 * statistics.median(a):>12.2f} "
              f"{1e3 * statistics.median(b):>8.2f} {ratio:>8.2f}x")


if __name__ == "__main__":
    main()
