"""Training speed: tcli vs JoeyNMT 2.3, the same data, subword model, model shape and batch size.

Issue 7 asks that tcli train faster than the alternatives on the same machine; JoeyNMT is the one
it names. Both toolkits train the shape of a tcli config (default: configs/multi30k_de_en.yaml,
4+4 layers x d_model 128) on Multi30k with the run's own joint sentencepiece model, batches of
`max_tokens` (longest side x sentences, padding included, as both count it), tied embeddings,
pre-LN, the same dropout, label smoothing and lr.
Each run is a fresh process that trains `--steps` updates with no validation; the figure is the
target tokens/s each toolkit logs per 50-update window (non-padding target tokens / wall time;
the first window, with start-up and warm-up, is dropped), median over windows and repeats. The
variants alternate (tcli-bf16, tcli-fp32, joeynmt-fp32, then again) so that load from other
processes hits them alike. JoeyNMT needs its own Python environment (its pins clash with ours;
it imports importlib_metadata without declaring it, and calls SetVocabulary, which sentencepiece
0.2.3 no longer has), made once with:

    python -m venv --system-site-packages /tmp/joeyenv
    /tmp/joeyenv/bin/pip install joeynmt==2.3.0 importlib_metadata sentencepiece==0.2.0
    python scripts/bench_joeynmt.py --joey-python /tmp/joeyenv/bin/python --steps 300 --repeats 2

What differs by design, not by setting: JoeyNMT batches sentences in random order (no length
bucketing, so more padding per batch) and tokenizes on the fly; it has no CPU bf16.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import hardware  # noqa: E402
from transformer_cli.config import load_config  # noqa: E402

JOEY_RATE = re.compile(r"Tokens per Sec:\s*([0-9.]+)")
WINDOW = 50  # updates per logged speed window, both toolkits


def joey_rates(log: str) -> list[float]:
    """The 'Tokens per Sec' of each JoeyNMT training log line, in order."""
    return [float(m.group(1)) for m in JOEY_RATE.finditer(log)]


def tcli_rates(metrics: Path) -> list[float]:
    """The tokens_per_s of each training row of a tcli run's metrics.jsonl, in order."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]


def joey_vocab(spm_vocab: Path, out: Path) -> int:
    """Write the sentencepiece pieces as a JoeyNMT vocab file (JoeyNMT adds its own specials)."""
    specials = {"<pad>", "<unk>", "<s>", "</s>"}
    pieces = [line.split("\t")[0] for line in spm_vocab.read_text(encoding="utf-8").splitlines()]
    pieces = [p for p in pieces if p not in specials]
    out.write_text("\n".join(pieces) + "\n", encoding="utf-8")
    return len(pieces)


def joey_config(cfg, work: Path, vocab: Path, spm_model: Path, steps: int, seed: int) -> dict:
    """A JoeyNMT 2.3 config with the shape and training settings of tcli config `cfg`."""
    m, t, d = cfg.model, cfg.train, cfg.data
    side = {"level": "bpe", "tokenizer_type": "sentencepiece", "voc_file": str(vocab),
            "tokenizer_cfg": {"model_file": str(spm_model)}, "max_length": d.max_len}
    stack = {"type": "transformer", "hidden_size": m.d_model, "ff_size": m.ff_size, "num_heads": m.num_heads,
             "dropout": m.dropout, "layer_norm": m.norm, "activation": m.activation,
             "embeddings": {"embedding_dim": m.d_model, "scale": True, "dropout": m.dropout}}
    return {
        "name": "bench_joeynmt", "model_dir": str(work / "joey_model"), "use_cuda": False, "fp16": False,
        "data": {"train": str(work / "text" / "train"), "dev": str(work / "text" / "val"),
                 "dataset_type": "plain",
                 "src": {"lang": d.src_lang, **side}, "trg": {"lang": d.tgt_lang, **side}},
        "training": {
            "random_seed": seed, "optimizer": "adam", "adam_betas": list(t.betas), "learning_rate": t.lr,
            "learning_rate_min": 1e-8, "learning_rate_warmup": t.warmup_steps,
            "scheduling": "warmupinversesquareroot", "label_smoothing": t.label_smoothing,
            "clip_grad_norm": t.clip_norm, "batch_size": t.max_tokens, "batch_type": "token",
            "normalization": "tokens", "updates": steps, "epochs": 1000, "validation_freq": 10 * steps,
            "logging_freq": WINDOW, "eval_metrics": ["bleu"], "overwrite": True, "shuffle": True,
            "keep_best_ckpts": 1},
        "testing": {"beam_size": 1},
        "model": {
            "initializer": "xavier_uniform", "embed_initializer": "xavier_uniform", "tied_embeddings": True,
            "tied_softmax": True,
            "encoder": {**stack, "num_layers": m.encoder_layers},
            "decoder": {**stack, "num_layers": m.decoder_layers}},
    }


def joey_version(python: str) -> str:
    """The joeynmt and torch versions of the JoeyNMT environment."""
    code = "import importlib.metadata as m; print('joeynmt', m.version('joeynmt'), 'torch', m.version('torch'))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_joeynmt: --joey-python {python} cannot import joeynmt: {proc.stderr.strip()[-300:]}")
    return proc.stdout.strip()


def run(variant: str, args, work: Path, joey_cfg: Path) -> dict:
    """Train one variant for args.steps updates in a fresh process; its speed windows and wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    if variant.startswith("joeynmt"):
        cmd = [args.joey_python, "-m", "joeynmt", "train", str(joey_cfg), "--skip-test"]
    else:
        precision = variant.split("-")[1]
        run_dir = work / f"tcli_{precision}"
        cmd = [sys.executable, "-m", "transformer_cli", "train", "--config", args.config, "--run-dir", str(run_dir),
               "--quiet", "--set", f"train.max_steps={args.steps}", "--set", f"train.valid_every={10 * args.steps}",
               "--set", f"train.log_every={WINDOW}", "--set", f"train.threads={args.threads}",
               "--set", f"train.precision={precision}", "--set", "train.max_minutes=0",
               "--set", f"train.seed={args.seed}"]
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"bench_joeynmt: {variant} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    if variant.startswith("joeynmt"):
        log = work / "joey_model" / "train.log"  # JoeyNMT empties its model_dir first (overwrite: True)
        rates = joey_rates(log.read_text()) if log.exists() else []
    else:
        rates = tcli_rates(run_dir / "metrics.jsonl")
    if len(rates) < 2:
        sys.exit(f"bench_joeynmt: {variant} logged {len(rates)} speed windows; raise --steps")
    print(f"bench_joeynmt: {variant}: {len(rates)} windows, median {statistics.median(rates[1:]):,.0f} "
          f"target tokens/s (first window dropped), {wall:.0f} s wall", file=sys.stderr)
    return {"rates": rates, "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--joey-python", required=True, help="a python with joeynmt 2.3 installed")
    ap.add_argument("--config", default="configs/multi30k_de_en.yaml", help="the tcli config whose shape both train")
    ap.add_argument("--steps", type=int, default=300, help="updates per run (speed windows of 50)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", default="tcli-bf16,tcli-fp32,joeynmt-fp32")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench_joeynmt"))
    ap.add_argument("--out", default="", help="write the results as JSON here (default: stdout only)")
    args = ap.parse_args()
    if args.steps < 2 * WINDOW:
        sys.exit(f"bench_joeynmt: --steps must be at least {2 * WINDOW}")
    joey = joey_version(args.joey_python)  # fail fast on a wrong environment
    work = Path(args.work).resolve()
    (work / "text").mkdir(parents=True, exist_ok=True)

    # tcli prepares (and caches) the tokenizer; JoeyNMT reads the same sentencepiece model
    prep = work / "prepared"
    subprocess.run([sys.executable, "-m", "transformer_cli", "prepare", "--config", args.config,
                    "--run-dir", str(prep)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    cfg = load_config(args.config)
    data = (ROOT / cfg.data.path).resolve()
    for split in ("train", "val"):  # plain text for JoeyNMT (a scratch copy under --work, git-ignored)
        for lang in (cfg.data.src_lang, cfg.data.tgt_lang):
            with gzip.open(data / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                (work / "text" / f"{split}.{lang}").write_text(f.read(), encoding="utf-8")
    vocab = work / "joey_vocab.txt"
    size = joey_vocab(prep / "tokenizer" / "joint.vocab", vocab)
    joey_cfg = work / "joey.yaml"
    joey_cfg.write_text(yaml.safe_dump(joey_config(cfg, work, vocab, prep / "tokenizer" / "joint.model",
                                                   args.steps, args.seed), sort_keys=False))

    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            runs[v].append(run(v, args, work, joey_cfg))
    results = {}
    for v, rs in runs.items():
        windows = [x for r in rs for x in r["rates"][1:]]
        results[v] = {"median_tokens_per_s": round(statistics.median(windows), 1), "windows": len(windows),
                      "runs": rs}
    report = {
        "command": "python scripts/bench_joeynmt.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "config": args.config,
        "hardware": hardware(), "joeynmt": joey,
        "steps": args.steps, "threads": args.threads, "vocab_pieces": size, "results": results,
    }
    if "joeynmt-fp32" in results:
        base = results["joeynmt-fp32"]["median_tokens_per_s"]
        report["speedup_vs_joeynmt"] = {v: round(r["median_tokens_per_s"] / base, 2)
                                        for v, r in results.items() if v != "joeynmt-fp32"}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
