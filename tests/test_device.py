"""Precision selection: auto is bf16 only where the device computes bf16 natively."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from transformer_cli.device import autocast, native_bf16, resolve_precision
from transformer_cli.errors import ConfigError

CPU = torch.device("cpu")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux), or None elsewhere."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return None
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def test_native_bf16_agrees_with_the_cpu_flags():
    """torch's probe and the kernel's flags tell the same story on this machine (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags on this system")
    assert native_bf16(CPU) == bool(flags & {"avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize("native", [False, True])
def test_auto_follows_native_support_and_says_so(monkeypatch, native):
    monkeypatch.setattr("transformer_cli.device.native_bf16", lambda device: native)
    precision, note = resolve_precision("auto", CPU, "train.precision")
    assert precision == ("bf16" if native else "fp32")
    assert note == f"train.precision auto: {precision} (this cpu {'computes bf16 natively' if native else 'has no native bf16'})"
    # an explicit choice is kept; bf16 without native support is only warned about
    assert resolve_precision("fp32", CPU, "train.precision") == ("fp32", None)
    precision, note = resolve_precision("bf16", CPU, "decode.precision")
    assert precision == "bf16" and (note is None) == native
    if not native:
        assert note.startswith("warning: decode.precision is bf16, but this CPU has no native bf16")


def test_unsupported_precisions_name_the_key():
    with pytest.raises(ConfigError, match="key 'decode.precision' is fp16, which needs a CUDA device"):
        resolve_precision("fp16", CPU, "decode.precision")
    with pytest.raises(ConfigError, match="key 'train.precision' bf16 is supported on cpu and cuda, not mps"):
        resolve_precision("bf16", torch.device("mps"), "train.precision")
    assert resolve_precision("auto", torch.device("mps"), "train.precision")[0] == "fp32"


def test_autocast_takes_resolved_precisions_only():
    with autocast(CPU, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(CPU, "fp32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with pytest.raises(ValueError, match="not 'auto'"):
        autocast(CPU, "auto")
