"""User-facing errors: the CLI prints `error: <message>` on stderr and exits with `exit_code`.

Exit codes: 2 = bad input the user gave (config, option, data file, checkpoint); 1 = a runtime
failure (training diverged, disk full, device unavailable). Anything else is a bug and keeps its
traceback.
"""


class TcliError(Exception):
    """A problem the user can act on that happened at run time; exit code 1."""

    exit_code = 1


class ConfigError(TcliError):
    """A bad config file, config key, override or command-line option; exit code 2."""

    exit_code = 2


class DataError(TcliError):
    """Bad or missing input: data files, input lines, tokenizer or checkpoint files; exit code 2."""

    exit_code = 2
