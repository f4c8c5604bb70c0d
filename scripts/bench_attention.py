"""Forward+backward time of our MultiHeadAttention (fast and explicit path) vs torch.nn.MultiheadAttention.

Self-attention with a key-padding mask (a quarter of the rows are half padding), as in an encoder.
The three implementations share weights and inputs and are timed in rotation, so load from other
processes hits all of them alike; medians over repeats after warmup. Usage:

    python scripts/bench_attention.py [--repeats 30] [--warmup 5] [--device cpu|cuda|all] [--mask padding|none|causal] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from transformer_cli.attention import MultiHeadAttention, causal_mask, sequence_mask

SHAPES = [(64, 32, 256, 4), (8, 512, 512, 8)]  # (batch, length, d_model, heads)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runners(batch, length, d_model, heads, device, mask_kind):
    """name -> closure running one forward+backward on shared weights and inputs."""
    torch.manual_seed(0)
    ours = MultiHeadAttention(d_model, heads).to(device)
    ref = torch.nn.MultiheadAttention(d_model, heads, batch_first=True).to(device)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(batch, length, d_model, device=device, requires_grad=True)
    lens = torch.full((batch,), length, device=device)
    lens[: batch // 4] = length // 2
    keep = sequence_mask(lens, length)  # (B, T) True = real token
    grad = torch.randn(batch, length, d_model, device=device)

    ref_kw, our_kw = {}, {}
    if mask_kind == "padding":
        ref_kw, our_kw = {"key_padding_mask": ~keep}, {"mask": keep[:, None, None, :]}
    elif mask_kind == "causal":
        ref_kw = {"attn_mask": ~causal_mask(length, device), "is_causal": True}
        our_kw = {"causal": True}

    def step(fn):
        def run():
            out = fn()
            out.backward(grad)
        return run

    return {
        "torch": step(lambda: ref(x, x, x, need_weights=False, **ref_kw)[0]),
        "fast": step(lambda: ours(x, x, x, **our_kw)[0]),
        "explicit": step(lambda: ours(x, x, x, need_weights=True, **our_kw)[0]),
    }


def bench(shape, device, repeats, warmup, mask_kind) -> dict[str, float]:
    """Median milliseconds per forward+backward for each implementation."""
    runners = _runners(*shape, device, mask_kind)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(warmup + repeats):
        for name, run in runners.items():
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="all", choices=["cpu", "cuda", "all"])
    parser.add_argument("--mask", default="padding", choices=["padding", "none", "causal"])
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, mask={args.mask}, "
          f"median of {args.repeats} after {args.warmup} warmup, forward+backward, fp32")
    print(f"{'device':<6} {'B':>3} {'T':>4} {'d':>4} {'H':>2} | {'torch ms':>9} {'fast ms':>9} "
          f"{'expl. ms':>9} | {'fast/torch':>10} {'expl/torch':>10}")
    for device in devices:
        for shape in SHAPES:
            t = bench(shape, device, args.repeats, args.warmup, args.mask)
            B, T, d, H = shape
            print(f"{device.type:<6} {B:>3} {T:>4} {d:>4} {H:>2} | {t['torch']:9.2f} {t['fast']:9.2f} "
                  f"{t['explicit']:9.2f} | {t['fast'] / t['torch']:9.2f}x {t['explicit'] / t['torch']:9.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
