"""tcli: train, run and evaluate encoder-decoder Transformers for machine translation."""

import os

__version__ = "0.1.0"

# oneDNN (CPU bf16 matmuls) keeps up to 1,024 compiled primitives, one per new shape. Batches change
# shape every step, so over a long bf16 training that cache alone grew the process by ~0.8 GB in 500
# updates (docs/benchmarks.md "Memory of long trainings"); 64 entries cost no measurable speed.
# Read by oneDNN at its first primitive, so this works as long as the package is imported before any
# bf16 matmul runs; a value the user exported wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")


def __getattr__(name):  # lazy, so `tcli --help` does not pay for importing torch
    if name == "Translator":
        from .translator import Translator

        return Translator
    raise AttributeError(name)
