"""The one error type the CLI turns into a single sentence and a non-zero exit, and the argument parser that raises
it."""

import argparse


class BenchError(Exception):
    """A user-facing problem: bad input, missing file, corrupt cache. Its message is one sentence."""


class Parser(argparse.ArgumentParser):
    """argparse for the commands outside Hydra (tables, reports, Spec-Bench files): a bad argument is one sentence
    (BenchError) and exit status 2, like every other bad input, not argparse's usage text."""

    def error(self, message):
        raise BenchError(f"{self.prog}: {message}.")
