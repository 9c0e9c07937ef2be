"""The one error type the CLI turns into a single sentence and a non-zero exit."""


class BenchError(Exception):
    """A user-facing problem: bad input, missing file, corrupt cache. Its message is one sentence."""
