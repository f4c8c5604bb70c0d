"""`python -m transformer_cli ...` (and `torchrun -m transformer_cli ...`) run the tcli CLI."""

from .cli import main

main()
