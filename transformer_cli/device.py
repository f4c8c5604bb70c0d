"""Device and precision selection: auto picks cuda, then mps, then cpu; precision auto picks bf16 where it is native."""

from __future__ import annotations

import contextlib

import torch

from .errors import ConfigError, TcliError


def resolve_device(name: str = "auto") -> torch.device:
    """Turn a config/option value into a torch.device, with a clear error if it is unavailable."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TcliError(f"unknown device '{name}'; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TcliError(f"device '{name}' was asked for, but CUDA is not available on this machine; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise TcliError(f"device '{name}' does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise TcliError(f"device '{name}' was asked for, but MPS is not available on this machine; use --device cpu")
    return device


def native_bf16(device: torch.device) -> bool:
    """Whether the device computes bf16 in hardware: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.4 has no including_emulation
            return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # torch.cpu's own CPU-feature probes (what inductor asks); missing in an older torch means "don't know"
        probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        return any(probe() for probe in probes if probe is not None)
    return False


def resolve_precision(precision: str, device: torch.device, key: str) -> tuple[str, str | None]:
    """The precision to run with, and a line to log about the choice (or None).

    auto is bf16 where the device computes bf16 natively, else fp32: on a CPU without AVX512-BF16 or
    AMX, bf16 autocast is emulated and trained 16-30x slower than fp32 (docs/benchmarks.md, Training).
    An explicit bf16 there is kept (numerics checks want it) with a warning.
    """
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"key '{key}' is fp16, which needs a CUDA device (this run uses {device.type}); "
                          "use auto, bf16 or fp32")
    if precision == "bf16" and device.type not in ("cpu", "cuda"):
        raise ConfigError(f"key '{key}' bf16 is supported on cpu and cuda, not {device.type}; use auto or fp32")
    native = native_bf16(device)
    if precision == "auto":
        chosen = "bf16" if native else "fp32"
        why = "computes bf16 natively" if native else "has no native bf16"
        return chosen, f"{key} auto: {chosen} (this {device.type} {why})"
    if precision == "bf16" and device.type == "cpu" and not native:
        return precision, (f"warning: {key} is bf16, but this CPU has no native bf16 (AVX512-BF16 or AMX): autocast "
                           "emulates it, many times slower than fp32; use auto or fp32")
    return precision, None


def autocast(device: torch.device, precision: str):
    """The autocast context for a resolved precision (fp32: none; losses and log-softmax stay fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in dtypes:  # "auto" must have gone through resolve_precision
        raise ValueError(f"autocast needs fp32, bf16 or fp16, not {precision!r}")
    return torch.autocast(device.type, dtype=dtypes[precision])
