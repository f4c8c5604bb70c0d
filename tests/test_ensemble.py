"""Ensemble decoding: the mean of the members' probabilities, through the unchanged search."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from transformer_cli import search
from transformer_cli.config import DecodeConfig, ModelConfig, TokenizerConfig
from transformer_cli.ensemble import Ensemble
from transformer_cli.model import Seq2SeqTransformer
from transformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_tokenizer
from transformer_cli.translator import Translator

from .fixtures_model import one_thread, smoke_run, tcli  # noqa: F401

VOCAB = 40


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # noqa: F811
    yield


def _model(seed: int, d_model: int, layers: int) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=d_model, num_heads=4, ff_size=2 * d_model, encoder_layers=layers,
                      decoder_layers=layers, dropout=0.0)
    model = Seq2SeqTransformer(cfg, VOCAB, VOCAB).eval()
    with torch.no_grad():  # a peakier output so hypotheses end at varied lengths
        model.output.weight.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def members():
    """Two different shapes, so splitting the joint memory by d_model is exercised."""
    return [_model(0, 32, 2), _model(1, 48, 1)]


@pytest.fixture(scope="module")
def sources():
    rng = random.Random(3)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, 16))] for _ in range(24)]


def _cfg(**kw):
    return DecodeConfig(**{"max_len_a": 1.0, "max_len_b": 4, "max_tokens": 4000, **kw})


def _reference_greedy(models, src: list[int], max_len: int) -> tuple[list[int], float]:
    """Greedy search written out: full forward passes, probabilities averaged by hand, argmax."""
    src_t = torch.tensor([src + [EOS_ID]])
    out: list[int] = []
    logprob = 0.0
    with torch.inference_mode():
        for step in range(max_len + 1):
            tgt = torch.tensor([[BOS_ID] + out])
            probs = torch.stack([F.softmax(m(src_t, tgt)[0, -1].float(), dim=-1) for m in models]).mean(0)  # (V,)
            probs[PAD_ID] = probs[BOS_ID] = 0.0
            if step == max_len:  # at the length limit only EOS is allowed
                token = EOS_ID
            else:
                token = int(probs.argmax())
            logprob += float(probs[token].log())
            if token == EOS_ID:
                return out, logprob
            out.append(token)
    return out, logprob


def test_greedy_ensemble_equals_averaged_probabilities_by_hand(members, sources):
    got = search.decode_nbest(Ensemble(members), sources, _cfg(), "cpu", beam=1)
    singles = [search.decode_nbest(m, sources, _cfg(), "cpu", beam=1) for m in members]
    differs = 0
    for src, hyps, *alone in zip(sources, got, *singles):
        tokens, logprob = _reference_greedy(members, src, search.max_output_len(len(src), 1.0, 4, 255))
        assert hyps[0].tokens == tokens
        assert hyps[0].logprob == pytest.approx(logprob, abs=1e-4)
        differs += any(a[0].tokens != tokens for a in alone)
    assert differs > len(sources) // 2  # the ensemble is neither member


@pytest.mark.parametrize("beam", [1, 3])
def test_ensemble_cached_equals_uncached_and_batch_invariant(members, sources, beam):
    ens = Ensemble(members)
    cached = search.decode_nbest(ens, sources, _cfg(), "cpu", beam=beam, nbest=beam)
    plain = search.decode_nbest(ens, sources, _cfg(), "cpu", beam=beam, nbest=beam, use_cache=False)
    for c, p in zip(cached, plain):
        assert [h.tokens for h in c] == [h.tokens for h in p]
        assert [h.score for h in c] == pytest.approx([h.score for h in p], abs=1e-5)
    alone = [search.decode_nbest(ens, [s], _cfg(), "cpu", beam=beam, nbest=beam)[0] for s in sources[:6]]
    as_tuples = lambda hyps: [(h.tokens, h.score) for h in hyps]  # noqa: E731
    assert [as_tuples(h) for h in alone] == [as_tuples(h) for h in cached[:6]]


def test_one_member_and_twice_the_same_member_decode_as_the_model(members, sources):
    model = members[0]
    single = search.decode_nbest(model, sources, _cfg(), "cpu", beam=3, nbest=2)
    for ens in (Ensemble([model]), Ensemble([model, model])):
        got = search.decode_nbest(ens, sources, _cfg(), "cpu", beam=3, nbest=2)
        for g, s in zip(got, single):
            assert [h.tokens for h in g] == [h.tokens for h in s]
            assert [h.score for h in g] == pytest.approx([h.score for h in s], abs=1e-5)


def test_members_need_one_target_vocabulary():
    other = Seq2SeqTransformer(ModelConfig(d_model=32, num_heads=4, ff_size=64, encoder_layers=1,
                                           decoder_layers=1), VOCAB, VOCAB + 1)
    with pytest.raises(ValueError, match="target vocabularies"):
        Ensemble([_model(0, 32, 1), other])


# ---------------------------------------------------------------------------------------------
# Run directories: the CLI and Translator.from_run_dir


@pytest.fixture
def second_run(smoke_run, tmp_path):  # noqa: F811
    """A copy of the smoke run whose best weights are perturbed: same tokenizer, another model."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "second"
    shutil.copytree(smoke_run, copy, ignore=shutil.ignore_patterns("hyps", "scores.json"))
    weights = copy / "checkpoints" / "best" / "model.safetensors"
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    tensors = {k: v + 0.05 * v.std().nan_to_num() * torch.randn(v.shape, generator=gen) if v.is_floating_point()
               and v.numel() > 1 else v for k, v in tensors.items()}
    save_file(tensors, weights)
    return copy


def test_translator_ensemble_is_the_mean_of_the_two_runs(smoke_run, second_run):  # noqa: F811
    lines = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch am Strand."]
    ens = Translator.from_run_dir(smoke_run, "best", device="cpu", decode={"beam": 2}, ensemble=[second_run])
    assert [p.name for p in ens.members] == ["model.safetensors"] * 2
    assert ens.members[1].parent.parent.parent == second_run
    a = Translator.from_run_dir(smoke_run, "best", device="cpu")
    b = Translator.from_run_dir(second_run, "best", device="cpu")
    # each member holds its own run's weights (and the two runs' weights differ)
    for member, single in zip(ens.model.members, (a.model, b.model)):
        assert all(torch.equal(x, y) for x, y in zip(member.state_dict().values(), single.state_dict().values()))
    assert not torch.equal(a.model.output.weight, b.model.output.weight)
    by_hand = Ensemble([a.model, b.model])
    ids = ens.encode(lines)
    expected = search.decode_nbest(by_hand, ids, ens.decode_cfg, "cpu", beam=2, nbest=1)
    assert ens.translate(lines) == ens.tokenizer.decode_tgt([h[0].tokens for h in expected])


def test_ensemble_member_can_name_its_own_checkpoint(smoke_run, second_run):  # noqa: F811
    best = second_run / "checkpoints" / "best"
    ens = Translator.from_run_dir(smoke_run, "last", device="cpu", ensemble=[best, best / "model.safetensors"])
    assert ens.members == [smoke_run / "checkpoints" / "last" / "model.safetensors",
                           best / "model.safetensors", best / "model.safetensors"]
    last = Translator.from_run_dir(smoke_run, "last", device="cpu").model
    perturbed = Translator.from_run_dir(second_run, "best", device="cpu").model
    for member, single in zip(ens.model.members, (last, perturbed, perturbed)):
        assert all(torch.equal(x, y) for x, y in zip(member.state_dict().values(), single.state_dict().values()))
    # a --checkpoint path is fine when every member names its own checkpoint
    weights = smoke_run / "checkpoints" / "last" / "model.safetensors"
    r = tcli("translate", "--run-dir", smoke_run, "--checkpoint", weights, "--ensemble", best, input="Ein Mann.\n")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_eval_with_ensemble_labels_its_files_and_scores(smoke_run, second_run, tmp_path):  # noqa: F811
    run = tmp_path / "first"
    shutil.copytree(smoke_run, run, ignore=shutil.ignore_patterns("hyps", "scores.json"))
    r = tcli("eval", "--run-dir", run, "--split", "valid", "--beam", 1, "--ensemble", second_run, "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    scores = json.loads(r.stdout)
    assert scores["hyp_file"] == str(run / "hyps" / "valid.best.beam1.ensemble2.txt")
    assert scores["ensemble"] == [str(run / "checkpoints" / "best" / "model.safetensors"),
                                  str(second_run / "checkpoints" / "best" / "model.safetensors")]
    saved = json.loads((run / "scores.json").read_text(encoding="utf-8"))
    assert saved["valid.best.beam1.ensemble2"]["bleu"] == scores["bleu"]
    assert scores["num_sentences"] == 1014


def test_ensemble_errors_are_one_line(smoke_run, tmp_path):  # noqa: F811
    other = tmp_path / "other"
    shutil.copytree(smoke_run, other, ignore=shutil.ignore_patterns("hyps", "scores.json"))
    # another direction
    cfg_path = other / "config.yaml"
    original = cfg_path.read_text(encoding="utf-8")
    cfg_path.write_text(original.replace("src_lang: de", "src_lang: fr"), encoding="utf-8")
    r = tcli("translate", "--run-dir", smoke_run, "--ensemble", other, input="Ein Mann.\n")
    assert r.returncode == 2 and "translates fr-en" in r.stderr and "Traceback" not in r.stderr
    cfg_path.write_text(original, encoding="utf-8")
    # another sentencepiece model (of a different size: its weights would not even load)
    shutil.rmtree(other / "tokenizer")
    text = ["Ein Mann fährt Fahrrad.", "A man rides a bike.", "Zwei Hunde spielen.", "Two dogs play."] * 50
    train_tokenizer(TokenizerConfig(vocab_size=36, byte_fallback=False), text, text, other / "tokenizer")
    r = tcli("translate", "--run-dir", smoke_run, "--ensemble", other, input="Ein Mann.\n")
    assert r.returncode == 2 and "tokenizer differs" in r.stderr and "Traceback" not in r.stderr
    # no run there
    r = tcli("translate", "--run-dir", smoke_run, "--ensemble", tmp_path / "missing", input="Ein Mann.\n")
    assert r.returncode != 0 and "missing/config.yaml" in r.stderr and "Traceback" not in r.stderr
    # a checkpoint path would load the same file for every member
    weights = smoke_run / "checkpoints" / "best" / "model.safetensors"
    r = tcli("translate", "--run-dir", smoke_run, "--checkpoint", weights, "--ensemble", smoke_run, input="Ein Mann.\n")
    assert r.returncode == 2 and "is a path" in r.stderr and "Traceback" not in r.stderr
    # a checkpoint folder outside a run dir: the run dir two levels up has no config to go with it
    loose = tmp_path / "loose" / "best"
    shutil.copytree(smoke_run / "checkpoints" / "best", loose)
    r = tcli("translate", "--run-dir", smoke_run, "--ensemble", loose, input="Ein Mann.\n")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'config.yaml'}:" in r.stderr and str(loose / "config.yaml") not in r.stderr
    # --hyp/--ref scoring has nothing to ensemble
    (tmp_path / "h.txt").write_text("a\n", encoding="utf-8")
    r = tcli("eval", "--hyp", tmp_path / "h.txt", "--ref", tmp_path / "h.txt", "--ensemble", other)
    assert r.returncode == 2 and "--ensemble" in r.stderr
