"""Checkpoints: safetensors round trip with tied weights, atomic switches, refused pickles, averaging."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from transformer_cli import checkpoint as ck
from transformer_cli.errors import DataError


class Tied(torch.nn.Module):
    """Embedding tied to the output projection, like the translation model."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight


def make(seed: int, **kw) -> Tied:
    torch.manual_seed(seed)
    return Tied(**kw)


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_round_trip_keeps_tying(tmp_path):
    model = make(0)
    ck.write_checkpoint(tmp_path / "checkpoints" / "last", model, {"step": 3}, state={"step": 3})
    other = make(1)
    assert not same(model, other)
    ck.load_weights(other, ck.resolve_checkpoint(tmp_path, "last"))
    assert same(model, other)
    assert other.out.weight is other.embed.weight  # still one tensor after loading
    assert ck.load_state(tmp_path / "checkpoints" / "last") == {"step": 3}
    assert ck.read_info(tmp_path / "checkpoints" / "last")["step"] == 3


def test_shape_mismatch_names_both_shapes(tmp_path):
    ck.save_weights(make(0, vocab=11), tmp_path / "m.safetensors")
    with pytest.raises(DataError, match=r"\(11, 6\).*\(13, 6\)"):
        ck.load_weights(make(0, vocab=13), tmp_path / "m.safetensors")


def test_truncated_file_is_a_data_error(tmp_path):
    path = tmp_path / "m.safetensors"
    ck.save_weights(make(0), path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DataError, match="not a valid safetensors"):
        ck.load_weights(make(0), path)


class Exploit:
    """Unpickling this runs code: it would create the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "checkpoints" / "last"
    folder.mkdir(parents=True)
    payload = pickle.dumps({"step": 1, "x": Exploit(marker)})
    (folder / "model.safetensors").write_bytes(payload)
    torch.save({"step": 1, "x": Exploit(marker)}, folder / "trainer_state.pt")
    with pytest.raises(DataError, match="refused"):
        ck.load_state(folder)
    with pytest.raises(DataError, match="not a valid safetensors"):
        ck.load_weights(make(0), folder / "model.safetensors")
    assert not marker.exists()


def test_failure_before_switch_keeps_previous(tmp_path):
    folder = tmp_path / "checkpoints" / "last"
    first = make(0)
    ck.write_checkpoint(folder, first, {"step": 1}, state={"step": 1})
    with pytest.raises(OSError, match="injected"):
        ck.write_checkpoint(folder, make(1), {"step": 2}, state={"step": 2}, fail_before_switch=True)
    loaded = make(2)
    ck.load_weights(loaded, ck.resolve_checkpoint(tmp_path, "last"))
    assert same(first, loaded) and ck.load_state(folder)["step"] == 1
    assert sorted(p.name for p in folder.parent.iterdir()) == ["last"]  # no temp folder left


def test_failure_inside_atomic_file_write_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    first = make(0)
    ck.save_weights(first, path)

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)  # the rename inside io_utils fails
    with pytest.raises(Exception, match="previous file is unchanged"):
        ck.save_weights(make(1), path)
    monkeypatch.undo()
    loaded = make(2)
    ck.load_weights(loaded, path)
    assert same(first, loaded)


def test_kill_between_renames_is_recovered(tmp_path):
    root = tmp_path / "checkpoints"
    model = make(0)
    ck.write_checkpoint(root / "last", model, {"step": 5}, state={"step": 5})
    os.replace(root / "last", root / ".last.old")  # what a kill after the first rename leaves
    assert ck.resolve_checkpoint(tmp_path, "last") == root / ".last.old" / "model.safetensors"
    assert ck.resumable(tmp_path) == root / ".last.old"
    ck.recover(tmp_path)
    assert (root / "last" / "trainer_state.pt").is_file() and not (root / ".last.old").exists()


def test_missing_checkpoint_lists_what_exists(tmp_path):
    ck.write_checkpoint(tmp_path / "checkpoints" / "best", make(0), {"step": 1})
    with pytest.raises(DataError, match="holds: best"):
        ck.resolve_checkpoint(tmp_path, "averaged")


def test_any_folder_under_checkpoints_resolves_by_name(tmp_path, monkeypatch):
    """`tcli average -o NAME` writes checkpoints/NAME: --checkpoint NAME must find it (it was refused)."""
    root = tmp_path / "run" / "checkpoints"
    ck.write_checkpoint(root / "avgbest5", make(0), {"step": 1})
    assert ck.is_checkpoint_name("avgbest5") and not ck.is_checkpoint_name("x/avgbest5")
    assert not ck.is_checkpoint_name("m.safetensors")
    assert ck.resolve_checkpoint(tmp_path / "run", "avgbest5") == root / "avgbest5" / "model.safetensors"
    ck.write_checkpoint(tmp_path / "here", make(1), {"step": 1})
    monkeypatch.chdir(tmp_path)  # a bare folder name outside the run dir still works as a path
    assert ck.resolve_checkpoint(tmp_path / "run", "here") == Path("here") / "model.safetensors"
    with pytest.raises(DataError, match="holds: avgbest5"):
        ck.resolve_checkpoint(tmp_path / "run", "avgbest6")


def test_prune_and_average(tmp_path):
    root = tmp_path / "checkpoints"
    models = {}
    for step, bleu in [(10, 5.0), (20, 9.0), (30, 7.0), (40, 6.0), (50, 8.0)]:
        models[step] = make(step)
        ck.write_checkpoint(root / ck.step_name(step), models[step], {"step": step, "valid_bleu": bleu})
    ck.prune(tmp_path, keep_last=2, keep_best=2, metric="bleu")
    assert [s for s, _, _ in ck.step_checkpoints(tmp_path)] == [20, 40, 50]  # last 2 + best 2 (20, 50)
    out, used = ck.average(tmp_path, best=2, metric="bleu")
    assert [f.name for f in used] == ["step_00000020", "step_00000050"]
    avg = make(99)
    ck.load_weights(avg, out / "model.safetensors")
    expect = (models[20].hidden.weight + models[50].hidden.weight) / 2
    assert torch.allclose(avg.hidden.weight, expect, atol=1e-7)
    assert json.loads((out / "info.json").read_text())["averaged"] == ["step_00000020", "step_00000050"]
    with pytest.raises(DataError, match="3 usable"):
        ck.average(tmp_path, last=4)
