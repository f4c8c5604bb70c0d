"""Forced decoding (scoring.py, `tcli score`) and n-best reranking with a channel model (scripts/rerank.py)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from transformer_cli import search
from transformer_cli.config import DecodeConfig, ModelConfig, read_yaml
from transformer_cli.ensemble import Ensemble
from transformer_cli.metrics import corpus_scores
from transformer_cli.model import Seq2SeqTransformer
from transformer_cli.scoring import score_batches, score_ids
from transformer_cli.tokenizer import BOS_ID, EOS_ID
from transformer_cli.translator import Translator

from .conftest import ROOT
from .fixtures_model import env_one_thread, one_thread, smoke_run, tcli  # noqa: F401

VOCAB = 40


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # noqa: F811
    yield


def _model(seed: int, d_model: int = 32, layers: int = 2) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=d_model, num_heads=4, ff_size=2 * d_model, encoder_layers=layers,
                      decoder_layers=layers, dropout=0.3)  # dropout > 0: scoring must switch it off
    model = Seq2SeqTransformer(cfg, VOCAB, VOCAB)
    with torch.no_grad():  # a peakier output so beam hypotheses end at varied lengths
        model.output.weight.mul_(3.0)
    return model


def _pairs(n: int, seed: int = 5):
    rng = random.Random(seed)
    srcs = [[rng.randrange(4, VOCAB) for _ in range(rng.randrange(0, 14))] for _ in range(n)]
    tgts = [[rng.randrange(4, VOCAB) for _ in range(rng.randrange(0, 12))] for _ in range(n)]
    return srcs, tgts


def _reference(model, src: list[int], tgt: list[int]) -> float:
    """log P(tgt + EOS | src) written out: one unpadded pair, a full forward pass, the chosen log-probabilities summed."""
    model.eval()
    with torch.inference_mode():
        logits = model(torch.tensor([src + [EOS_ID]]), torch.tensor([[BOS_ID] + tgt]))[0].float()  # (T, V)
    logp = F.log_softmax(logits, dim=-1)
    return float(sum(logp[t, y] for t, y in enumerate(tgt + [EOS_ID])))


@pytest.mark.parametrize("max_tokens", [16, 4000])  # one pair per batch .. everything padded together
def test_score_ids_equals_the_pairs_scored_one_by_one(max_tokens):
    model = _model(0).train()
    srcs, tgts = _pairs(20)
    got = score_ids(model, srcs, tgts, "cpu", max_tokens=max_tokens)
    assert model.training  # the caller's mode is restored
    want = [_reference(model, s, t) for s, t in zip(srcs, tgts)]
    assert got == pytest.approx(want, abs=1e-4)
    assert all(g < 0 for g in got)


def test_score_batches_cover_every_pair_once_within_the_budget():
    rng = random.Random(1)
    src_lens = [rng.randrange(1, 30) for _ in range(200)]
    tgt_lens = [rng.randrange(1, 30) for _ in range(200)]
    batches = score_batches(src_lens, tgt_lens, max_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        assert len(b) == 1 or len(b) * max(max(src_lens[i], tgt_lens[i]) for i in b) <= 100


def test_beam_hypotheses_score_their_own_search_log_probability():
    """The search's summed log-probability of every n-best hypothesis is what forced decoding gives it."""
    model = _model(2).eval()
    srcs, _ = _pairs(12, seed=9)
    cfg = DecodeConfig(beam=4, nbest=4, max_len_a=1.0, max_len_b=4, alpha=0.6)
    nbest = search.decode_nbest(model, srcs, cfg, "cpu")
    hyps = [(s, h) for s, hs in zip(srcs, nbest) for h in hs]
    scored = score_ids(model, [s for s, _ in hyps], [h.tokens for _, h in hyps], "cpu")
    assert scored == pytest.approx([h.logprob for _, h in hyps], abs=1e-4)
    assert len({len(h.tokens) for _, h in hyps}) > 1


def test_ensemble_scores_with_the_mean_of_the_probabilities():
    models = [_model(3).eval(), _model(4, d_model=48, layers=1).eval()]
    srcs, tgts = _pairs(8, seed=2)
    got = score_ids(Ensemble(models).eval(), srcs, tgts, "cpu")
    with torch.inference_mode():
        for g, s, t in zip(got, srcs, tgts):
            probs = torch.stack([F.softmax(m(torch.tensor([s + [EOS_ID]]), torch.tensor([[BOS_ID] + t]))[0].float(), -1)
                                 for m in models]).mean(0)  # (T, V)
            assert g == pytest.approx(float(sum(probs[i, y].log() for i, y in enumerate(t + [EOS_ID]))), abs=1e-4)


def test_score_ids_rejects_unaligned_lists():
    with pytest.raises(ValueError, match="3 sources but 2 targets"):
        score_ids(_model(0), [[5]] * 3, [[5]] * 2, "cpu")


# The command line and the Translator


SOURCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "", "Eine Frau liest ein Buch am Strand."]
TARGETS = ["A man rides a bike.", "Two dogs play in the snow.", "Nothing.", ""]


def _write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_tcli_score_prints_log_probabilities_per_line(smoke_run, tmp_path):  # noqa: F811
    src, tgt = _write(tmp_path, "s.de", SOURCES), _write(tmp_path, "t.en", TARGETS)
    result = tcli("score", "--run-dir", smoke_run, "-s", src, "-t", tgt)
    assert result.returncode == 0, result.stderr
    sums = [float(x) for x in result.stdout.split("\n")[:-1]]
    translator = Translator.from_run_dir(smoke_run)
    want = translator.score(SOURCES, TARGETS)
    assert sums == pytest.approx([lp for lp, _ in want], abs=1e-3)
    assert want[3][1] == 1 and sums[3] < 0  # an empty target is scored as its EOS alone
    tokens = sum(n for _, n in want)
    assert f"scored 4 pairs, {tokens} target tokens" in result.stderr
    per_token = tcli("score", "--run-dir", smoke_run, "-s", src, "-t", tgt, "--per-token", "-q")
    assert per_token.returncode == 0 and per_token.stderr == ""
    got = [float(x) for x in per_token.stdout.split()]
    assert got == pytest.approx([lp / n for lp, n in want], abs=1e-3)
    # the model prefers its own translation to a reference it has not learned
    (hyp,) = translator.translate([SOURCES[0]])
    (own, n_own), (ref, n_ref) = translator.score([SOURCES[0]] * 2, [hyp, "The the the the purple sky."])
    assert own / n_own > ref / n_ref


def test_tcli_score_writes_a_file_and_takes_an_ensemble(smoke_run, tmp_path):  # noqa: F811
    src, tgt = _write(tmp_path, "s.de", SOURCES), _write(tmp_path, "t.en", TARGETS)
    out = tmp_path / "scores.txt"
    alone = tcli("score", "--run-dir", smoke_run, "-s", src, "-t", tgt, "-o", out, "-q")
    assert alone.returncode == 0 and alone.stdout == "", alone.stderr
    twice = tcli("score", "--run-dir", smoke_run, "-s", src, "-t", tgt, "-q", "--ensemble", smoke_run)
    assert twice.returncode == 0, twice.stderr
    # the same model twice: the mean of two equal distributions is that distribution
    assert [float(x) for x in twice.stdout.split()] == pytest.approx([float(x) for x in out.read_text().split()], abs=1e-3)


def test_tcli_score_errors_are_one_line(smoke_run, tmp_path):  # noqa: F811
    src, short = _write(tmp_path, "s.de", SOURCES), _write(tmp_path, "t.en", TARGETS[:2])
    cases = [
        (["-s", src, "-t", short], f"--src {src} has 4 lines but --tgt {short} has 2"),
        (["-s", src, "-t", tmp_path / "missing.en"], "missing.en: file not found"),
        (["-s", src, "-t", src, "--run-dir", tmp_path], "no config.yaml"),
    ]
    for extra, message in cases:
        args = ["score", "--run-dir", smoke_run, *extra] if "--run-dir" not in extra else ["score", *extra]
        result = tcli(*args)
        assert result.returncode != 0
        assert message in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# scripts/rerank.py


def _rerank(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "rerank.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=env_one_thread(), timeout=600)


def test_pick_adds_the_weighted_features():
    sys.path.insert(0, str(ROOT / "scripts"))
    from rerank import pick, regroup

    # (beam score, channel, rescorer) per candidate
    scores = [[(-1.0, -4.0, 0.0), (-1.5, -1.0, 0.0), (-3.0, 0.0, -9.0)], [(-2.0, -1.0, -1.0), (-2.0, -1.0, -1.0)]]
    assert pick(scores, (0.0, 0.0)) == [0, 0]
    assert pick(scores, (0.5, 0.0)) == [1, 0]  # -3.0 / -2.0 / -3.0; the tie goes to the first
    assert pick(scores, (10.0, 0.0)) == [2, 0]
    assert pick(scores, (10.0, 1.0)) == [1, 0]  # the rescorer vetoes the third
    assert regroup([1, 2, 3, 4, 5], [["a", "b", "c"], ["d", "e"]]) == [[1, 2, 3], [4, 5]]


@pytest.fixture
def reverse_run(smoke_run, tmp_path):  # noqa: F811
    """The smoke run relabelled en -> de: with its joint tokenizer it can score English -> German."""
    copy = tmp_path / "reverse"
    shutil.copytree(smoke_run, copy, ignore=shutil.ignore_patterns("hyps", "scores.json"))
    cfg = read_yaml(copy / "config.yaml")
    cfg["data"]["src_lang"], cfg["data"]["tgt_lang"] = "en", "de"
    (copy / "config.yaml").write_text(json.dumps(cfg), encoding="utf-8")  # JSON is YAML
    return copy


def test_rerank_weight_zero_is_beam_search_and_others_use_the_channel(smoke_run, reverse_run, tmp_path):  # noqa: F811
    out = tmp_path / "reranked.en"
    result = _rerank("--run-dir", smoke_run, "--channel", reverse_run, "--split", "test", "--nbest", "3",
                     "--weights", "0,10000", "--out", out, "--quiet")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["weight"], r["rescorer_weight"]) for r in rows] == [(0.0, 0.0), (10000.0, 0.0)]
    from transformer_cli.data import load_split

    data = load_split(smoke_run, "test")
    beam = Translator.from_run_dir(smoke_run, decode={"beam": 3}).translate(data.src_text)
    plain = corpus_scores(beam, data.tgt_text)
    assert rows[0]["changed"] == 0 and rows[0]["bleu"] == round(plain["bleu"], 2)
    # the 60-step smoke model barely tells candidates apart, so only a large weight moves choices
    assert rows[1]["changed"] > 0
    best = max(rows, key=lambda r: r["bleu"])
    written = out.read_text(encoding="utf-8").splitlines()
    assert len(written) == len(data.src_text)
    assert round(corpus_scores(written, data.tgt_text)["bleu"], 2) == best["bleu"]


def test_rerank_alpha_is_the_length_penalty_of_its_beam_search(smoke_run, reverse_run):  # noqa: F811
    """--alpha decodes the n-best with that length penalty: weight 0 then equals `translate` with it."""
    from transformer_cli.data import load_split

    data = load_split(smoke_run, "test")
    bleu = {alpha: round(corpus_scores(Translator.from_run_dir(smoke_run, decode={"beam": 3, "alpha": alpha})
                                       .translate(data.src_text), data.tgt_text)["bleu"], 2)
            for alpha in (0.6, 3.0)}  # 0.6: decode.alpha by default
    assert bleu[0.6] != bleu[3.0]  # else this test could not tell whether --alpha is used
    result = _rerank("--run-dir", smoke_run, "--channel", reverse_run, "--split", "test", "--nbest", "3",
                     "--alpha", "3", "--weights", "0", "--quiet")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[0])["bleu"] == bleu[3.0]


def test_rerank_with_a_rescorer_follows_its_scores(smoke_run, tmp_path):  # noqa: F811
    """With a huge rescorer weight each sentence keeps the candidate the rescorer scores best per token."""
    from safetensors.torch import load_file, save_file

    run, other = tmp_path / "run", tmp_path / "other"
    for path in (run, other):
        shutil.copytree(smoke_run, path, ignore=shutil.ignore_patterns("hyps", "scores.json"))
    weights = other / "checkpoints" / "last" / "model.safetensors"  # the rescorer: a perturbed model
    gen = torch.Generator().manual_seed(0)
    save_file({k: v + 0.3 * v.std().nan_to_num() * torch.randn(v.shape, generator=gen)
               if v.is_floating_point() and v.numel() > 1 else v for k, v in load_file(weights).items()}, weights)
    out = tmp_path / "reranked.en"
    result = _rerank("--run-dir", run, "--rescorer", other / "checkpoints" / "last", "--split", "test", "--nbest", "4",
                     "--rescorer-weights", "1000000", "--out", out, "--quiet")
    assert result.returncode == 0, result.stderr
    from transformer_cli.data import load_split

    data = load_split(run, "test")
    n = 40  # check the first sentences by hand
    direct = Translator.from_run_dir(run, decode={"beam": 4, "nbest": 4})
    rescorer = Translator.from_run_dir(other, "last")
    nbest = direct.translate_nbest(data.src_text[:n])
    written = out.read_text(encoding="utf-8").splitlines()
    changed = 0
    for src, cands, got in zip(data.src_text, nbest, written):
        per_token = [lp / k for lp, k in rescorer.score([src] * len(cands), [c for c, _ in cands])]
        assert got == cands[max(range(len(cands)), key=lambda i: (per_token[i], -i))][0]
        changed += got != cands[0][0]
    assert changed > 0  # the check above is not only beam search's own choice


def test_rerank_with_a_right_to_left_run_follows_its_backward_scores(smoke_run, tmp_path):  # noqa: F811
    """--r2l: with a huge weight each sentence keeps the candidate the right-to-left run scores best per
    token, read from the last subword to the first (here the smoke model's weights under an r2l config)."""
    from transformer_cli.config import save_config

    r2l = tmp_path / "r2l"
    shutil.copytree(smoke_run, r2l, ignore=shutil.ignore_patterns("hyps", "scores.json"))
    cfg = Translator.from_run_dir(r2l, "last").cfg
    cfg.decode.precision = "fp32"  # bf16 would let batching flip near ties between candidates
    save_config(cfg, r2l / "config.yaml")
    cache, scorer = tmp_path / "cache", r2l / "checkpoints" / "last"
    common = ("--run-dir", smoke_run, "--split", "test", "--nbest", "4", "--cache", cache, "--quiet")
    assert _rerank(*common, "--rescorer", scorer, "--rescorer-weights", "0").returncode == 0  # cached left to right
    cfg.data.target_order = "r2l"  # the same weights file, now read right to left: its cached scores must not serve
    save_config(cfg, r2l / "config.yaml")
    out = tmp_path / "reranked.en"
    result = _rerank(*common, "--r2l", scorer, "--r2l-weights", "1000000", "--out", out)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["weight"], r["rescorer_weight"], r["r2l_weight"]) for r in rows] == [(0, 0, 1000000)]
    from transformer_cli.data import load_split

    data = load_split(smoke_run, "test")
    n = 40
    direct = Translator.from_run_dir(smoke_run, decode={"beam": 4, "nbest": 4})
    backward, forward = Translator.from_run_dir(r2l, "last"), Translator.from_run_dir(smoke_run, "last")
    nbest = direct.translate_nbest(data.src_text[:n])
    written = out.read_text(encoding="utf-8").splitlines()
    changed = differs = 0
    for src, cands, got in zip(data.src_text, nbest, written):
        texts = [c for c, _ in cands]
        per_token = [lp / k for lp, k in backward.score([src] * len(texts), texts)]
        assert got in texts and per_token[texts.index(got)] == pytest.approx(max(per_token), abs=1e-5)
        changed += got != texts[0]
        differs += per_token != [lp / k for lp, k in forward.score([src] * len(texts), texts)]
    assert changed > 0 and differs == n  # not beam search's own choice, and not the left-to-right scores
    wrong = _rerank("--run-dir", smoke_run, "--r2l", smoke_run, "--split", "valid", "--quiet")
    assert wrong.returncode == 2 and "writes left to right (data.target_order: l2r); pass it as --rescorer" in wrong.stderr


def test_rerank_cache_is_reused_and_follows_the_weights_files(smoke_run, reverse_run, tmp_path):  # noqa: F811
    cache = tmp_path / "cache"
    args = ("--run-dir", smoke_run, "--channel", reverse_run, "--split", "valid", "--nbest", "2",
            "--weights", "0,10000", "--cache", cache, "--quiet")
    first = _rerank(*args)
    assert first.returncode == 0, first.stderr
    files = sorted(cache.iterdir())
    assert len(files) == 2  # the n-best lists and the channel's scores
    # a cached value is what the next run uses: make the channel's scores favour every second candidate
    for path in files:
        entry = json.loads(path.read_text())
        if entry["key"]["what"] == "channel":
            entry["value"] = [0.0 if i % 2 else -1.0 for i in range(len(entry["value"]))]
            path.write_text(json.dumps(entry))
    second = _rerank(*args)
    assert second.returncode == 0, second.stderr
    rows = [json.loads(line) for line in second.stdout.splitlines()]
    assert rows[0] == json.loads(first.stdout.splitlines()[0])  # weight 0: beam search, as before
    assert rows[1]["changed"] == len(load_split_texts(smoke_run))  # every sentence took its second candidate
    (reverse_run / "checkpoints" / "best" / "model.safetensors").touch()  # a retrained channel: scored again
    assert _rerank(*args).returncode == 0
    assert len(list(cache.iterdir())) == 3


def load_split_texts(run):
    from transformer_cli.data import load_split

    return load_split(run, "valid").src_text


def test_rerank_errors_are_one_line(smoke_run):  # noqa: F811
    cases = [
        (["--channel", smoke_run], "it must translate en-de, the reverse of"),
        ([], "give --channel RUN (a reverse-direction run) and/or --rescorer RUN"),
        (["--rescorer", smoke_run, "--rescorer-weights", "a,b"], "--rescorer-weights: give comma-separated numbers"),
    ]
    for extra, message in cases:
        result = _rerank("--run-dir", smoke_run, *extra, "--split", "valid", "--quiet")
        assert result.returncode == 2
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
