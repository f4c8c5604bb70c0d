"""Training speed: tcli's training step vs a plain torch.nn.Transformer loop, side by side in one run.

Both train the Multi30k de-en benchmark shape (configs/multi30k_de_en_base.yaml: 3+3 layers, d_model
256, 4 heads, FFN 1024, joint sentencepiece 8k, tied embeddings, pre-LN, dropout 0.3) on the SAME
length-bucketed 4096-token batches of `batching.token_batches`, in fp32 and bf16 autocast. The four
variants run interleaved in rounds (so load from other processes hits them alike; by default one
step per variant per round: the four variants run the same batch back to back). Each step's target
tokens / seconds is one sample; reported: the medians, their ratio, and the median of the per-batch
ratios (tcli / reference on the same batch, a few seconds apart: the figure least hurt by other jobs
on a shared machine). After the rounds every variant has made the same updates on the same batches,
so the validation losses compare numerics (bf16 vs fp32). Peak resident memory is measured in a
fresh child process per variant (ru_maxrss is per process).

    python scripts/bench_train.py --steps 30
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.batching import collate, token_batches  # noqa: E402
from transformer_cli.config import load_config  # noqa: E402
from transformer_cli.data import load_split, prepare  # noqa: E402
from transformer_cli.device import autocast  # noqa: E402
from transformer_cli.train import Dist, Trainer  # noqa: E402

VARIANTS = ("tcli-fp32", "ref-fp32", "tcli-bf16", "ref-bf16")


class RefModel(nn.Module):
    """The reference: nn.Transformer with tied embeddings and sinusoidal positions, like a tutorial."""

    def __init__(self, vocab: int, d_model: int, heads: int, ff: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=0)
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ff, dropout, batch_first=True,
                                          norm_first=True)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.drop = nn.Dropout(dropout)
        pos = torch.arange(1024).unsqueeze(1) * torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2) / d_model)
        table = torch.zeros(1024, d_model)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos), torch.cos(pos)
        self.register_buffer("pos", table, persistent=False)
        self.scale = math.sqrt(d_model)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        src_pad, tgt_pad = src == 0, tgt_in == 0
        s = self.drop(self.embed(src) * self.scale + self.pos[: src.shape[1]])
        t = self.drop(self.embed(tgt_in) * self.scale + self.pos[: tgt_in.shape[1]])
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        h = self.transformer(s, t, tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                             memory_key_padding_mask=src_pad, tgt_is_causal=True)
        return self.out(h)


class RefLoop:
    """A plain training loop: Adam, LambdaLR inverse-sqrt, mean label-smoothed CE, clip, step."""

    def __init__(self, cfg, vocab: int, precision: str):
        m, t = cfg.model, cfg.train
        torch.manual_seed(t.seed)
        self.model = RefModel(vocab, m.d_model, m.num_heads, m.ff_size, m.encoder_layers, m.dropout)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.eps)
        w = t.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min((s + 1) / w, math.sqrt(w / (s + 1))))
        self.cfg, self.precision = cfg, precision

    def step(self, batch) -> None:
        self.opt.zero_grad()
        with autocast(torch.device("cpu"), self.precision):
            logits = self.model(batch.src, batch.tgt_in)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1), ignore_index=0,
                                   label_smoothing=self.cfg.train.label_smoothing)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_norm)
        self.opt.step()
        self.sched.step()

    @torch.no_grad()
    def valid_loss(self, split, batches) -> float:
        self.model.eval()
        total, tokens = 0.0, 0
        for idx in batches:
            b = collate(split, idx)
            with autocast(torch.device("cpu"), self.precision):
                logits = self.model(b.src, b.tgt_in)
            total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b.tgt_out.reshape(-1),
                                     ignore_index=0, reduction="sum").item()
            tokens += b.num_tgt_tokens
        self.model.train()
        return total / tokens


class OursLoop:
    """tcli's own Trainer: model.py + Trainer.train_update (the code `tcli train` runs)."""

    def __init__(self, cfg, run_dir: Path, precision: str):
        cfg.train.precision = precision
        self.trainer = Trainer(cfg, run_dir, Dist(device=torch.device("cpu")), quiet=True, resume_command="")
        self.loss_acc = torch.zeros(())
        self.model = self.trainer.model
        if cfg.train.compile:
            self.module = torch.compile(self.model, dynamic=True)
        else:
            self.module = self.model

    def step(self, batch) -> None:
        self.trainer.train_update([batch], batch.num_tgt_tokens, self.loss_acc, self.module)

    def valid_loss(self, split, batches) -> float:
        self.model.eval()
        try:
            return self.trainer.valid_loss()
        finally:
            self.model.train()


def setup(args):
    cfg = load_config(ROOT / "configs" / "multi30k_de_en_base.yaml", [
        f"train.threads={args.threads}", f"train.warmup_steps={args.warmup}", "train.max_steps=100000",
        f"train.compile={str(args.compile).lower()}",
    ])
    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    prepare(cfg, run_dir, quiet=True)
    train = load_split(run_dir, "train")
    batches = token_batches(train.src_lens + 1, train.tgt_lens + 1, cfg.train.max_tokens, cfg.train.seed, 1)
    return cfg, run_dir, train, batches


def make(variant: str, cfg, run_dir: Path, vocab: int):
    impl, precision = variant.split("-")
    if impl == "tcli":
        import copy

        return OursLoop(copy.deepcopy(cfg), run_dir, precision)
    return RefLoop(cfg, vocab, precision)


def peak_rss_child(args, variant: str) -> float:
    """Peak RSS (MB) of a fresh process that loads the data and trains `variant` for a few steps."""
    cmd = [sys.executable, __file__, "--rss-child", variant, "--run-dir", args.run_dir, "--threads", str(args.threads),
           "--warmup", str(args.warmup), "--rss-steps", str(args.rss_steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]


def rss_child(args) -> None:
    cfg, run_dir, train, batches = setup(args)
    from transformer_cli.tokenizer import Tokenizer

    loop = make(args.rss_child, cfg, run_dir, Tokenizer.load(run_dir / "tokenizer").tgt_vocab_size)
    for idx in batches[: args.rss_steps]:
        loop.step(collate(train, idx))
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM (ru_maxrss would include the parent's peak, it survives exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--rounds", type=int, default=0, help="interleaving rounds the steps are split into (0 = one per step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=100, help="lr warmup steps (short, so the losses move)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile", action="store_true", help="torch.compile tcli's model (train.compile)")
    ap.add_argument("--rss-steps", type=int, default=8)
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "bench_train"))
    ap.add_argument("--rss-child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        return rss_child(args)

    cfg, run_dir, train, batches = setup(args)
    from transformer_cli.tokenizer import Tokenizer

    vocab = Tokenizer.load(run_dir / "tokenizer").tgt_vocab_size
    variants = args.variants.split(",")
    loops = {v: make(v, cfg, run_dir, vocab) for v in variants}
    warm = 2
    plan = batches[: warm + args.steps]
    collated = [collate(train, idx) for idx in plan]
    samples: dict[str, list[float]] = {v: [] for v in variants}
    per_round = math.ceil(args.steps / (args.rounds or args.steps))
    chunks = [list(range(warm))] + [list(range(s, min(s + per_round, len(plan)))) for s in range(warm, len(plan), per_round)]
    for r, chunk in enumerate(chunks):
        for v in variants:
            for i in chunk:
                t0 = time.perf_counter()
                loops[v].step(collated[i])
                dt = time.perf_counter() - t0
                if r > 0:
                    samples[v].append(collated[i].num_tgt_tokens / dt)
        print(f"round {r}/{len(chunks) - 1}: " + ", ".join(
            f"{v} {statistics.median(samples[v]):,.0f}" for v in variants if samples[v]), file=sys.stderr, flush=True)

    valid = load_split(run_dir, "valid")
    vbatches = token_batches(valid.src_lens + 1, valid.tgt_lens + 1, 2 * cfg.train.max_tokens, 0, 0, shuffle=False)
    results = {}
    for v in variants:
        results[v] = {"tgt_tok_per_s_median": round(statistics.median(samples[v])),
                      "valid_loss": round(loops[v].valid_loss(valid, vbatches), 4)}
    if not args.no_rss:
        for v in variants:
            results[v]["peak_rss_mb"] = round(peak_rss_child(args, v))
    real = sum(b.num_tgt_tokens for b in collated[warm:]) / len(collated[warm:])
    print(f"{len(plan) - warm} timed steps per variant, mean {real:,.0f} real target tokens per batch, "
          f"{args.threads} threads, torch {torch.__version__}")
    print(f"{'variant':<10} {'tgt tok/s':>10} {'vs ref':>7} {'paired':>7} {'valid loss':>10} {'peak RSS MB':>11}")
    for v in variants:
        ref_name = "ref-" + v.split("-")[1]
        ratio = paired = float("nan")
        if ref_name in results:
            ratio = results[v]["tgt_tok_per_s_median"] / results[ref_name]["tgt_tok_per_s_median"]
            paired = statistics.median(a / b for a, b in zip(samples[v], samples[ref_name]))
            results[v]["ratio_of_medians"], results[v]["median_paired_ratio"] = round(ratio, 3), round(paired, 3)
        print(f"{v:<10} {results[v]['tgt_tok_per_s_median']:>10,} {ratio:>6.2f}x {paired:>6.2f}x "
              f"{results[v]['valid_loss']:>10.4f} {results[v].get('peak_rss_mb', float('nan')):>11}")
    if "tcli-fp32" in results and "tcli-bf16" in results:
        a, b = results["tcli-fp32"]["valid_loss"], results["tcli-bf16"]["valid_loss"]
        print(f"bf16 vs fp32 valid loss: {100 * (b - a) / a:+.2f}%")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
