"""Device selection: auto picks cuda, then mps, then cpu."""

from __future__ import annotations

import torch

from .errors import TcliError


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
