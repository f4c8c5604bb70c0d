"""Decoding speed on Multi30k test_2016_flickr: greedy and beam 5, with and without the KV cache,
and the cost per token at forced output lengths 10 / 50 / 200.

    python scripts/bench_decode.py --run-dir runs/bench_decode --threads 2

Uses the run's checkpoint (or random weights with --random), fp32, on the CPU. Times are medians
of --repeats runs. "Without cache" re-runs the decoder on the whole prefix at every step (the
reference a toolkit without incremental decoding pays). Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.search import decode_nbest  # noqa: E402
from transformer_cli.translator import Translator  # noqa: E402


def load(args) -> Translator:
    """The run's Translator; with --random, the same architecture with fresh random weights."""
    t = Translator.from_run_dir(args.run_dir, args.checkpoint, device="cpu")
    if args.random:
        from transformer_cli.model import build_model

        torch.manual_seed(0)
        t.model = build_model(t.cfg, t.tokenizer.src_vocab_size, t.tokenizer.tgt_vocab_size).eval()
    return t


def timed(fn, repeats: int):
    """(median wall seconds, median CPU seconds of this process, last result) of `repeats` calls.

    On a shared machine the CPU time shows what the work costs when it is not waiting for a core.
    """
    times, cpu, result = [], [], None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(times), statistics.median(cpu), result


def throughput(t: Translator, ids, beam: int, use_cache: bool, repeats: int) -> dict:
    """Sentences/s and target tokens/s (best hypotheses, EOS included) over all of `ids`."""
    cfg = dataclasses.replace(t.decode_cfg, beam=beam, nbest=1, precision="fp32")
    secs, cpu, hyps = timed(lambda: decode_nbest(t.model, ids, cfg, "cpu", use_cache=use_cache), repeats)
    tokens = sum(len(h[0].tokens) + 1 for h in hyps)
    return {"secs": secs, "cpu": cpu, "sent_s": len(ids) / secs, "tok_s": tokens / secs,
            "avg_len": tokens / len(ids), "sent_cpu_s": len(ids) / cpu}


def per_token(t: Translator, ids, beam: int, length: int, use_cache: bool, repeats: int) -> float:
    """Milliseconds per target token (per sentence) when every output is forced to `length` tokens."""
    cfg = dataclasses.replace(t.decode_cfg, beam=beam, nbest=1, precision="fp32", min_len=length,
                              max_len_a=0.0, max_len_b=length)
    secs, cpu, hyps = timed(lambda: decode_nbest(t.model, ids, cfg, "cpu", use_cache=use_cache), repeats)
    assert all(len(h[0].tokens) == length for h in hyps)
    return 1000 * cpu / (len(ids) * (length + 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/bench_decode")
    p.add_argument("--checkpoint", default="best")
    p.add_argument("--random", action="store_true", help="random weights instead of the checkpoint")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit", type=int, default=0, help="first N test sentences only (0 = all 1,000)")
    p.add_argument("--per-token-sentences", type=int, default=16)
    p.add_argument("--uncached-every", type=int, default=5, help="decode every Nth sentence with and without cache")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t = load(args)
    with gzip.open(ROOT / "data" / "multi30k" / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    lines = lines[: args.limit] if args.limit else lines
    ids = t.encode(lines, warn=None)
    m = t.cfg.model
    print(f"model: {m.encoder_layers}+{m.decoder_layers} layers, d_model {m.d_model}, ff {m.ff_size}, "
          f"vocab {t.tokenizer.tgt_vocab_size}, weights {'random' if args.random else t.checkpoint}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(ids)} sentences; "
          f"alpha {t.decode_cfg.alpha}, max_len {t.decode_cfg.max_len_a}*src+{t.decode_cfg.max_len_b}", flush=True)
    decode_nbest(t.model, ids[:64], t.decode_cfg, "cpu")  # warm-up

    subset = ids[:: args.uncached_every]  # the uncached runs are long: every Nth sentence
    rows = {}
    for beam in (1, 5):
        rows[(beam, "all")] = throughput(t, ids, beam, True, args.repeats)
        rows[(beam, "sub")] = throughput(t, subset, beam, True, args.repeats)
        rows[(beam, "sub-nocache")] = throughput(t, subset, beam, False, 1)
        for key in ("all", "sub", "sub-nocache"):
            r = rows[(beam, key)]
            print(f"beam {beam} {key:12s}: {r['sent_s']:7.1f} sent/s {r['tok_s']:8.0f} tok/s  "
                  f"({r['secs']:.2f} s wall, {r['cpu']:.2f} s CPU, {r['avg_len']:.1f} tokens/sentence)", flush=True)
    print("\n| search | sentences | KV cache | sentences/s | target tokens/s | tokens/sentence | sentences per CPU-s "
          "| cache speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for beam in (1, 5):
        name = "greedy" if beam == 1 else f"beam {beam}"
        ratio = rows[(beam, "sub-nocache")]["cpu"] / rows[(beam, "sub")]["cpu"]  # CPU time: robust to a busy machine
        for key, n, cache, note in (("all", len(ids), "yes", ""), ("sub", len(subset), "yes", f"{ratio:.2f}x"),
                                    ("sub-nocache", len(subset), "no", "")):
            r = rows[(beam, key)]
            print(f"| {name} | {n} | {cache} | {r['sent_s']:.1f} | {r['tok_s']:.0f} | {r['avg_len']:.1f} "
                  f"| {r['sent_cpu_s']:.1f} | {note} |")

    sub = ids[: args.per_token_sentences]
    print(f"\nCPU ms per target token (per sentence), every output forced to L tokens, {len(sub)} sentences in one batch:")
    print("\n| search | KV cache | L = 10 | L = 50 | L = 200 |")
    print("|---|---|---|---|---|")
    for beam, use_cache, lengths in ((1, True, (10, 50, 200)), (5, True, (10, 50, 200)), (1, False, (10, 50))):
        cells = [f"{per_token(t, sub, beam, L, use_cache, args.repeats if use_cache else 1):.3f}" for L in lengths]
        cells += ["(not run: quadratic)"] * (3 - len(cells))
        print(f"| {'greedy' if beam == 1 else f'beam {beam}'} | {'yes' if use_cache else 'no'} | {' | '.join(cells)} |",
              flush=True)


if __name__ == "__main__":
    main()
