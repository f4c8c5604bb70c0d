"""Forward+backward time of the whole model under CPU bf16 autocast: SDPA fast path vs explicit path.

A probe for issue 4's bf16 target (the profile puts SDPA's CPU backward at ~27% of a bf16 step).
Same model, batch and weights; the two paths are timed in rotation; medians after one warmup.

    python scripts/bench_bf16_attention_path.py
"""

import statistics
import time

import torch

from transformer_cli import attention as A
from transformer_cli.config import Config
from transformer_cli.model import build_model

torch.manual_seed(0)
cfg = Config()
cfg.model.dropout = 0.3
model = build_model(cfg, 8000, 8000).train()
B, S, T = 140, 26, 28  # about one 4,096-token Multi30k batch
src = torch.randint(4, 8000, (B, S))
tgt = torch.randint(4, 8000, (B, T))
sdpa = A.MultiHeadAttention.attend


def explicit(self, q, k, v, mask=None, causal=False, need_weights=False):
    """The explicit (matmul + softmax) path, whatever need_weights says."""
    out, weights = sdpa(self, q, k, v, mask, causal, True)
    return out, (weights if need_weights else None)


def step() -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt)
    logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


times = {"sdpa": [], "explicit": []}
for _ in range(6):
    for name, fn in (("sdpa", sdpa), ("explicit", explicit)):
        A.MultiHeadAttention.attend = fn
        times[name].append(step())
for name, values in times.items():
    print(f"{name:9s} {statistics.median(values[1:]) * 1000:.0f} ms per fwd+bwd ({torch.get_num_threads()} threads)")
