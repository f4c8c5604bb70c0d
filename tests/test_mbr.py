"""MBR selection: golden utilities by hand, the choice through the Translator and `tcli eval`, errors."""

from __future__ import annotations

import json
import math

import pytest

from transformer_cli import Translator
from transformer_cli.cli import main
from transformer_cli.mbr import expected_utility, mbr_order

from .fixtures_model import one_thread, smoke_run  # noqa: F401
from .test_eval_cli import run_main

SOURCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch im Park.",
           "Ein kleines Mädchen klettert auf einen Baum.", "Drei Männer stehen vor einem Gebäude.",
           "Ein Hund rennt über eine grüne Wiese.", "Kinder spielen Fußball auf der Straße.",
           "Ein Mann in einem roten Hemd kocht.", "Eine Gruppe von Leuten sitzt am Strand.",
           "Ein Junge springt in einen See."]


def test_golden_utilities():
    # identical pair: 100 against each other, 0 against the outlier (no shared word) -> (100 + 0) / 2
    assert expected_utility(["x y z w", "a b c d", "a b c d"]) == pytest.approx([0.0, 50.0, 50.0])
    assert mbr_order(["x y z w", "a b c d", "a b c d"]) == [1, 2, 0]  # the tie keeps the beam's order
    assert expected_utility(["a b c d"]) == [0.0] and mbr_order(["a b c d"]) == [0]
    # asymmetric, by BLEU's formula: the short one matches every n-gram of its own but pays the brevity
    # penalty exp(1 - 8/4); the long one has precisions 4/8, 3/7, 2/6, 1/5 and no penalty
    short, long_ = "a b c d", "a b c d e f g h"
    golden = [100 * math.exp(1 - 8 / 4), 100 * (4 / 8 * 3 / 7 * 2 / 6 * 1 / 5) ** 0.25]  # 36.79, 34.57
    assert expected_utility([short, long_]) == pytest.approx(golden)
    assert mbr_order([short, long_]) == [0, 1] and mbr_order([long_, short]) == [1, 0]
    assert mbr_order(["x y z w", "a b c d", "a b c d"], "chrf") == [1, 2, 0]


def test_translator_picks_the_consensus_of_the_beam(smoke_run, one_thread):  # noqa: F811
    plain = Translator.from_run_dir(smoke_run, decode={"beam": 4})
    mbr = Translator.from_run_dir(smoke_run, decode={"beam": 4, "mbr": 4})
    nbest = plain.translate_nbest(SOURCES, nbest=4)
    picked = mbr.translate(SOURCES)
    assert picked == [hs[mbr_order([h for h, _ in hs])[0]][0] for hs in nbest]
    assert picked != [hs[0][0] for hs in nbest]  # on these sentences MBR changes some choice
    # with --nbest the same hypotheses and scores come back, reordered by expected utility
    for hs, reordered in zip(nbest, mbr.translate_nbest(SOURCES, nbest=4)):
        assert sorted(hs) == sorted(reordered)
    assert [len(h) for h in mbr.translate_nbest(SOURCES, nbest=2)] == [2] * len(SOURCES)


def test_eval_mbr_keeps_the_beam_files(smoke_run, one_thread, capsys):  # noqa: F811
    code, out, err = run_main(capsys, "eval", "--run-dir", smoke_run, "--split", "valid", "--json", "--quiet",
                              "--beam", 3, "--mbr", 3, "--mbr-metric", "chrf")
    assert code == 0, err
    scores = json.loads(out)
    assert scores["hyp_file"].endswith("valid.best.beam3.mbr3chrf.txt") and scores["mbr"] == 3
    assert scores["mbr_metric"] == "chrf"
    table = json.loads((smoke_run / "scores.json").read_text(encoding="utf-8"))
    assert table["valid.best.beam3.mbr3chrf"]["mbr"] == 3
    assert all("mbr" not in v for k, v in table.items() if ".mbr" not in k)  # plain beam rows stay plain


@pytest.mark.parametrize("args, word", [
    (["--beam", 2, "--mbr", 3], "decode.mbr"),
    (["--beam", 4, "--mbr", 1], "decode.mbr"),
    (["--beam", 4, "--mbr", 4, "--sampling"], "decode.mbr"),
    (["--beam", 4, "--mbr", 4, "--mbr-metric", "ter"], "decode.mbr_metric"),
])
def test_mbr_option_errors(smoke_run, capsys, args, word):  # noqa: F811
    with pytest.raises(SystemExit) as exit_info:
        main(["translate", "--run-dir", str(smoke_run), "-i", "/dev/null", *map(str, args)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and word in err, err
