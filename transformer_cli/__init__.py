"""tcli: train, run and evaluate encoder-decoder Transformers for machine translation."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `tcli --help` does not pay for importing torch
    if name == "Translator":
        from .translator import Translator

        return Translator
    raise AttributeError(name)
