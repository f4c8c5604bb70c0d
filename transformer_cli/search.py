"""Greedy, beam and sampling search over the model's KV cache, batched across sentences.

Every search is incremental: the decoder sees only the newest token per step, the self-attention
keys/values of earlier steps come from the explicit `KVCache`, and the cross-attention keys/values
are projected once per sentence. `use_cache=False` re-runs the decoder on the whole prefix (for
tests and benchmarks only).

Batch invariance (a sentence decodes to the same tokens whatever batch or position it is in).
Float results change with the shapes of the computation, so the shapes a sentence sees are made a
function of that sentence alone:
- sources are padded to a canonical length, a multiple of SRC_BUCKET of their own length, and a
  batch only holds sentences of one canonical length; masked keys get exactly zero weight;
- CPU matmuls (MKL) compute a row differently when a call has very few rows (gemv for 1 row, small
  kernels below ~12), so every encoder/decoder call gets at least MIN_ROWS rows, padding the batch
  with filler copies of a real sentence whose results are thrown away;
- every other step (log_softmax, top-k, length penalty, sampling noise) works row by row.
Finished sentences are compacted out of the batch (cache rows dropped with `KVCache.reorder`).
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .config import DecodeConfig
from .device import autocast
from .tokenizer import BOS_ID, EOS_ID, PAD_ID

SRC_BUCKET = 8  # sources are padded to a multiple of this many tokens
MIN_ROWS = 16  # fewest rows per model call (see the module docstring)
NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    """One output: token ids (no BOS/EOS), length-normalised score and summed log-probability."""

    tokens: list[int]
    score: float
    logprob: float


def length_penalty(length: int | torch.Tensor, alpha: float):
    """GNMT length penalty ((5 + length) / 6) ** alpha; length counts the EOS token."""
    return ((5.0 + length) / 6.0) ** alpha


def canonical_src_len(length: int) -> int:
    """Padded source length for a source of `length` tokens (EOS included)."""
    return max(SRC_BUCKET, -(-length // SRC_BUCKET) * SRC_BUCKET)


def max_output_len(src_len: int, a: float, b: int, cap: int) -> int:
    """Most tokens (EOS excluded) a hypothesis for a source of src_len bare tokens may have."""
    return max(1, min(int(a * src_len + b), cap))


def pad_sources(srcs: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources (with EOS) to ids (B, S) and mask (B, S), S a canonical length."""
    S = canonical_src_len(max(len(s) for s in srcs))
    src = torch.full((len(srcs), S), PAD_ID, dtype=torch.long)
    for i, s in enumerate(srcs):
        src[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    src = src.to(device)
    return src, src != PAD_ID


# ---------------------------------------------------------------------------------------------
# Shared step pieces


def _min_slots(rows_per_slot: int, src_len: int) -> int:
    """Fewest sentences (slots) per batch so encoder (slots*S) and decoder (slots*k) calls get MIN_ROWS rows."""
    return max(-(-MIN_ROWS // rows_per_slot), -(-MIN_ROWS // src_len))


def _fill(index: torch.Tensor, size: int) -> torch.Tensor:
    """Pad a 1-D index to `size` entries by repeating its first entry (filler rows)."""
    if index.numel() >= size:
        return index
    return torch.cat([index, index[:1].expand(size - index.numel())])


def _next_log_probs(model, hist: torch.Tensor, memory, src_mask, cache, use_cache: bool) -> torch.Tensor:
    """Log-probabilities (R, V) of the next token after prefixes hist (R, t) (BOS first), in fp32."""
    # need_weights=True takes the explicit attention path: on CPU, SDPA with one query row splits
    # the keys across threads depending on the batch size, so its results depend on the batch.
    if use_cache:
        logits = model.decode(hist[:, -1:], memory, src_mask, cache=cache, need_weights=True)  # (R, 1, V)
    else:  # the whole prefix again (reference path for tests and benchmarks)
        logits = model.decode(hist, memory, src_mask, need_weights=True)  # (R, t, V)
    return F.log_softmax(logits[:, -1].float(), dim=-1)


def _constrain(logp: torch.Tensor, step: int, min_len: int, max_lens: torch.Tensor) -> torch.Tensor:
    """No PAD/BOS ever, no EOS before min_len tokens, only EOS once a row has max_lens tokens. logp (R, V)."""
    logp[:, PAD_ID] = NEG_INF  # never generated: PAD and BOS only ever sit in model inputs
    logp[:, BOS_ID] = NEG_INF
    if step < min_len:
        logp[:, EOS_ID] = NEG_INF
    at_max = max_lens <= step  # (R,)
    if bool(at_max.any()):
        eos = logp[:, EOS_ID].clone()
        logp[at_max] = NEG_INF
        logp[:, EOS_ID] = torch.where(at_max, eos, logp[:, EOS_ID])
    return logp


def _compact(done: torch.Tensor, rows_per_slot: int, min_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the unfinished slots (padded with filler copies to min_slots).

    Returns (slot index (N,), row index (N * rows_per_slot,), filler flags (N,)).
    """
    keep = (~done).nonzero().flatten()
    slots = _fill(keep, min_slots)
    rows = (slots[:, None] * rows_per_slot + torch.arange(rows_per_slot, device=slots.device)).reshape(-1)  # (N*k,)
    return slots, rows, torch.arange(len(slots), device=slots.device) >= keep.numel()


def _should_compact(done: torch.Tensor, min_slots: int) -> bool:
    """Drop finished slots once they are at least 1/8 of the batch and the batch can shrink."""
    n, n_done = done.numel(), int(done.sum())
    return n > min_slots and n_done >= max(1, n // 8)


# ---------------------------------------------------------------------------------------------
# Sampling noise: counter-based, so a sentence's samples depend on (seed, its source, step) only.


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (int64 tensor in, values in [0, 2^32) out); products stay below 2^63."""
    x = x & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


def sentence_keys(srcs: Sequence[Sequence[int]], seed: int) -> torch.Tensor:
    """One int64 key per sentence from its source ids and the seed (the sampling stream)."""
    keys = []
    for s in srcs:
        h = seed & 0xFFFFFFFF
        for tok in s:
            h = (h * 1000003 + int(tok) + 1) & 0xFFFFFFFF
        keys.append(h)
    return torch.tensor(keys, dtype=torch.long)


def _uniform(keys: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Uniform(0, 1) noise (R, V) from row keys (R,), the step and the token id."""
    tok = torch.arange(vocab, device=keys.device)
    x = _hash32(_hash32(keys[:, None] * 0x3504F333 + step) + tok[None, :] * 0x1B873593)  # (R, V)
    return (x.double() + 0.5) / 4294967296.0


def sample_tokens(logp: torch.Tensor, keys: torch.Tensor, step: int, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """Draw one token per row from softmax(logp / temperature) cut to top_k / top_p (Gumbel-max)."""
    z = logp / temperature  # (R, V)
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]  # (R, 1)
        z = z.masked_fill(z < kth, NEG_INF)
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
        probs = sorted_z.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # mass before this token already covers top_p
        z = z.scatter(-1, order, sorted_z.masked_fill(drop, NEG_INF))
    gumbel = -torch.log(-torch.log(_uniform(keys, step, z.shape[-1])))
    return (z.double() + gumbel).argmax(-1)  # (R,)


# ---------------------------------------------------------------------------------------------
# Greedy (and sampling)


def greedy_search(
    model,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    max_len: int | Sequence[int],
    min_len: int = 0,
    alpha: float = 0.0,
    use_cache: bool = True,
    sampler: Callable | None = None,
    keys: torch.Tensor | None = None,
) -> list[Hypothesis]:
    """Best-first token per step (or a sampled one with `sampler`) for src (B, S); one Hypothesis per sentence."""
    B, S = src.shape
    device = src.device
    max_lens = torch.as_tensor([max_len] * B if isinstance(max_len, int) else list(max_len), device=device)
    min_slots = _min_slots(1, S)
    slots = _fill(torch.arange(B, device=device), min_slots)  # sentence id of each row
    memory = model.encode(src[slots], src_mask[slots])
    mask = src_mask[slots]
    cache = model.new_cache()
    hist = torch.full((len(slots), 1), BOS_ID, dtype=torch.long, device=device)  # (R, t)
    score = torch.zeros(len(slots), device=device)  # summed log-probs (R,)
    done = torch.zeros(len(slots), dtype=torch.bool, device=device)
    done[B:] = True  # fillers
    out: list[Hypothesis | None] = [None] * B
    row_keys = keys.to(device)[slots] if keys is not None else None
    for step in range(int(max_lens.max()) + 1):
        logp = _constrain(_next_log_probs(model, hist, memory, mask, cache, use_cache), step, min_len, max_lens[slots])
        total = score[:, None] + logp  # (R, V)
        if sampler is not None:
            token = sampler(logp, row_keys, step)
            score = score + logp.gather(1, token[:, None]).squeeze(1)
        else:
            score, token = (t.squeeze(1) for t in total.topk(1, dim=-1))
        hist = torch.cat([hist, token[:, None]], dim=1)  # (R, t + 1)
        if step == 0 and use_cache:  # the same canonical (copied) cache layout as after compaction
            cache.reorder(torch.arange(len(hist), device=device))
        finished = (token == EOS_ID) & ~done
        for r in finished.nonzero().flatten().tolist():
            length = hist.shape[1] - 1  # generated tokens, EOS included
            tokens = hist[r, 1:-1].tolist()
            out[int(slots[r])] = Hypothesis(tokens, float(score[r]) / length_penalty(length, alpha), float(score[r]))
        done = done | finished
        if bool(done.all()):
            break
        if _should_compact(done, min_slots):
            _, rows, done = _compact(done, 1, min_slots)
            slots, hist, score, mask, memory = slots[rows], hist[rows], score[rows], mask[rows], memory[rows]
            row_keys = row_keys[rows] if row_keys is not None else None
            cache.reorder(rows)
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Beam search


@dataclass
class _Finished:
    """Finished hypotheses of every sentence of a beam-search batch, best first."""

    hyps: list[list[Hypothesis]]
    nbest: int

    def add(self, sent: int, hyp: Hypothesis) -> None:
        """Keep hyp among the sentence's finished hypotheses (sorted by score, stable)."""
        hyps = self.hyps[sent]
        pos = next((i for i, h in enumerate(hyps) if hyp.score > h.score), len(hyps))
        hyps.insert(pos, hyp)

    def threshold(self, sent: int) -> float:
        """Score an alive beam must beat to enter the n-best (-inf while fewer than nbest are done)."""
        hyps = self.hyps[sent]
        return hyps[self.nbest - 1].score if len(hyps) >= self.nbest else -math.inf


def _best_possible(scores: torch.Tensor, step: int, max_lens: torch.Tensor, alpha: float) -> torch.Tensor:
    """Upper bound (N,) on the final score of any continuation of the alive beams scores (N, k).

    Log-probs only fall as tokens are added, so the bound is the best summed log-prob over the
    length penalty that flatters it most: the longest allowed length when alpha > 0.
    """
    best = scores.max(dim=1).values  # (N,)
    longest = max_lens.to(scores.dtype) + 1  # tokens with EOS
    shortest = torch.full_like(best, step + 2)  # a current beam plus its EOS
    length = longest if alpha > 0 else shortest
    return best / length_penalty(length, alpha)


def _beam_step(scores: torch.Tensor, logp: torch.Tensor, k: int):
    """Expand N sentences x k beams: (candidate scores, beam, token), each (N, 2k), best first."""
    N, V = scores.shape[0], logp.shape[-1]
    total = (scores[:, :, None] + logp.view(N, k, V)).view(N, k * V)  # (N, k*V)
    top_scores, top_index = total.topk(min(2 * k, k * V), dim=1)  # (N, 2k)
    return top_scores, top_index // V, top_index % V


def _select_alive(top_scores, top_beam, top_token, k: int):
    """The k best candidates that do not end in EOS: (scores, beam, token), each (N, k)."""
    rank = torch.arange(top_scores.shape[1], device=top_scores.device)
    key = rank + (top_token == EOS_ID).long() * top_scores.shape[1]  # EOS candidates sort last
    pick = key.argsort(dim=1)[:, :k]  # (N, k)
    return top_scores.gather(1, pick), top_beam.gather(1, pick), top_token.gather(1, pick)


def _finalize(finished: _Finished, sents, hist, top_scores, top_beam, top_token, active, k, alpha):
    """Move EOS candidates ranked within the top k of an active sentence to `finished`."""
    is_final = (top_token[:, :k] == EOS_ID) & (top_scores[:, :k] > NEG_INF) & active[:, None]  # (N, k)
    length = hist.shape[1]  # generated tokens so far + the EOS
    for slot, rank in is_final.nonzero().tolist():
        row = slot * k + int(top_beam[slot, rank])
        logprob = float(top_scores[slot, rank])
        tokens = hist[row, 1:].tolist()
        finished.add(int(sents[slot]), Hypothesis(tokens, logprob / length_penalty(length, alpha), logprob))


def _first_step(model, memory, mask, cache, k: int, use_cache: bool) -> torch.Tensor:
    """Log-probs (N*k, V) of the first token for N slots (memory (N, S, d)), the cache grown to k beams.

    All beams start from BOS, so the decoder runs once per sentence (and projects the encoder
    keys/values once), then the cache is copied to the k beams. The copy also matters for batch
    invariance: attention over a copied (contiguous) key tensor and over the strided one the
    projection made differ in the last bits, and compaction copies; so every path uses a copy.
    """
    N = memory.shape[0]
    rows = _fill(torch.arange(N, device=memory.device), MIN_ROWS)  # at least MIN_ROWS rows
    hist = torch.full((len(rows), 1), BOS_ID, dtype=torch.long, device=memory.device)  # (R, 1)
    logp = _next_log_probs(model, hist, memory[rows], mask[rows], cache, use_cache)[:N]  # (N, V)
    beams = torch.arange(N, device=memory.device).repeat_interleave(k)  # (N*k,): slot of each beam
    if use_cache:
        cache.reorder(beams)
    return logp[beams]


def beam_search(
    model,
    src: torch.Tensor,
    src_mask: torch.Tensor,
    beam: int,
    alpha: float,
    max_len: int | Sequence[int],
    min_len: int = 0,
    nbest: int = 1,
    use_cache: bool = True,
) -> list[list[Hypothesis]]:
    """Beam search for src (B, S): per sentence the nbest finished hypotheses, best first.

    A sentence stops when `beam` hypotheses have finished, or when `nbest` have and no alive beam
    can still beat the nbest-th (see `_best_possible`), or at its maximum length.
    """
    B, S = src.shape
    k, device = beam, src.device
    nbest = min(nbest, k)
    max_lens = torch.as_tensor([max_len] * B if isinstance(max_len, int) else list(max_len), device=device)
    min_slots = _min_slots(k, S)
    sents = _fill(torch.arange(B, device=device), min_slots)  # sentence of each slot (N,)
    done = torch.arange(len(sents), device=device) >= B  # fillers count as done from the start
    memory, mask = model.encode(src[sents], src_mask[sents]), src_mask[sents]  # (N, S, d), (N, S)
    cache = model.new_cache()
    first = _first_step(model, memory, mask, cache, k, use_cache)  # (N*k, V)
    memory, mask = memory.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0)  # k beams per slot
    hist = torch.full((len(sents) * k, 1), BOS_ID, dtype=torch.long, device=device)  # (N*k, t)
    scores = torch.zeros(len(sents), k, device=device)
    scores[:, 1:] = NEG_INF  # all beams start equal: expand only the first one
    finished = _Finished([[] for _ in range(B)], nbest)
    for step in range(int(max_lens.max()) + 1):
        N = len(sents)
        slot_max = max_lens[sents]  # (N,)
        logp = first if step == 0 else _next_log_probs(model, hist, memory, mask, cache, use_cache)  # (N*k, V)
        logp = _constrain(logp, step, min_len, slot_max.repeat_interleave(k))
        top_scores, top_beam, top_token = _beam_step(scores, logp, k)
        _finalize(finished, sents, hist, top_scores, top_beam, top_token, ~done, k, alpha)
        scores, beam_idx, token = _select_alive(top_scores, top_beam, top_token, k)
        reorder = (torch.arange(N, device=device)[:, None] * k + beam_idx).view(-1)  # (N*k,) rows to keep
        hist = torch.cat([hist[reorder], token.view(-1, 1)], dim=1)  # (N*k, t + 1)
        if use_cache:
            cache.reorder(reorder, cross=False)  # beams of one slot share its encoder keys/values
        done = done | (slot_max <= step) | _slot_done(finished, sents, scores, step, slot_max, alpha, k)
        if bool(done.all()):
            break
        if _should_compact(done, min_slots):
            keep, rows, done = _compact(done, k, min_slots)
            sents, scores, hist, memory, mask = sents[keep], scores[keep], hist[rows], memory[rows], mask[rows]
            if use_cache:
                cache.reorder(rows)
    return [finished.hyps[i][:nbest] for i in range(B)]


def _slot_done(finished: _Finished, sents, scores, step, slot_max, alpha, k) -> torch.Tensor:
    """Per slot: beam hypotheses finished, or none alive can enter the n-best any more."""
    bound = _best_possible(scores, step, slot_max, alpha).tolist()
    done = [len(finished.hyps[s]) >= k or b <= finished.threshold(s)
            for s, b in zip(sents.tolist(), bound)]
    return torch.tensor(done, device=scores.device)


# ---------------------------------------------------------------------------------------------
# Whole lists of sentences


def make_batches(src_lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Index lists of sentences sharing one canonical length, at most max_tokens padded source tokens each.

    Lengths include EOS. Sentences are sorted by length inside a bucket so that batch-mates tend to
    finish together; every batch holds at least one sentence.
    """
    order = sorted(range(len(src_lens)), key=lambda i: (canonical_src_len(src_lens[i]), src_lens[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        S = canonical_src_len(src_lens[i])
        if current and (canonical_src_len(src_lens[current[0]]) != S or (len(current) + 1) * S > max_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@contextlib.contextmanager
def inference(model, device: torch.device, precision: str, total: int, progress: bool):
    """Eval mode (no dropout), inference_mode and autocast around a decoding loop; yields a progress bar.

    The model's training flag is restored afterwards: validation decodes in the middle of training.
    """
    bar = _progress(total, progress)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast(device, precision):
            yield bar
    finally:
        model.train(was_training)
        bar.close()


def model_max_len(model) -> int:
    """Longest input (EOS included) the model (or Ensemble) accepts: its cfg.max_len."""
    return getattr(getattr(model, "cfg", None), "max_len", 1024)


def prepare_sources(srcs: Sequence[Sequence[int]], max_positions: int) -> list[list[int]]:
    """Bare source ids to model inputs: truncated to max_positions tokens including the EOS appended."""
    return [list(s)[: max(max_positions - 1, 0)] + [EOS_ID] for s in srcs]


def decode_nbest(
    model,
    srcs: Sequence[Sequence[int]],
    cfg: DecodeConfig,
    device,
    beam: int | None = None,
    nbest: int | None = None,
    use_cache: bool = True,
    progress: bool = False,
) -> list[list[Hypothesis]]:
    """Decode bare source ids (no specials), batched by length; per sentence its n-best, in input order."""
    device = torch.device(device)
    beam = cfg.beam if beam is None else beam
    nbest = min(cfg.nbest if nbest is None else nbest, beam)
    limit = model_max_len(model)
    inputs = prepare_sources(srcs, limit)
    max_lens = [max_output_len(len(s) - 1, cfg.max_len_a, cfg.max_len_b, limit - 1) for s in inputs]
    keys = sentence_keys(inputs, seed=cfg.seed) if cfg.sampling else None
    results: list[list[Hypothesis]] = [[] for _ in inputs]
    with inference(model, device, cfg.precision, len(inputs), progress) as bar:
        for batch in make_batches([len(s) for s in inputs], cfg.max_tokens):
            hyps = _decode_batch(model, [inputs[i] for i in batch], [max_lens[i] for i in batch],
                                 cfg, device, beam, nbest, use_cache,
                                 None if keys is None else keys[batch])
            for i, h in zip(batch, hyps):
                results[i] = h
            bar.update(len(batch))
    return results


def _decode_batch(model, inputs, max_lens, cfg: DecodeConfig, device, beam, nbest, use_cache, keys):
    """One batch of prepared sources: n-best lists in batch order."""
    src, src_mask = pad_sources(inputs, device)
    if cfg.sampling:
        def sampler(logp, row_keys, step):
            return sample_tokens(logp, row_keys, step, cfg.temperature, cfg.top_k, cfg.top_p)

        hyps = greedy_search(model, src, src_mask, max_lens, cfg.min_len, cfg.alpha, use_cache, sampler, keys)
        return [[h] for h in hyps]
    if beam == 1:
        hyps = greedy_search(model, src, src_mask, max_lens, cfg.min_len, cfg.alpha, use_cache)
        return [[h] for h in hyps]
    return beam_search(model, src, src_mask, beam, cfg.alpha, max_lens, cfg.min_len, nbest, use_cache)


def decode_ids(model, srcs: Sequence[Sequence[int]], cfg: DecodeConfig, device, beam=None) -> list[list[int]]:
    """Best hypothesis ids (no specials) for bare source ids, in input order (used by validation)."""
    return [h[0].tokens for h in decode_nbest(model, srcs, cfg, device, beam=beam, nbest=1)]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    """A tqdm bar on stderr, or a stand-in that does nothing."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="sent", file=sys.stderr, leave=False)
