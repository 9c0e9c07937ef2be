"""The foundation every other package stands on; it imports none of them.

- :mod:`core.errors`: the one exception a user sees as one sentence (``BenchError``).
- :mod:`core.schema`: settings declared with type, range, default and meaning; checked in one sentence.
- :mod:`core.artifacts`: the one load-or-build cache for everything built or trained, keyed by its content.
- :mod:`core.model_parts`: where a model family keeps its decoder layers and sub-layers.
- :mod:`core.counting` and :mod:`core.flops`: forward passes counted per role, analytic FLOPs.
- :mod:`core.clock`: the device-synchronised clock.  :mod:`core.kernels`: packed CPU linears.
- :mod:`core.metrics`: ratios and acceptance statistics, each defined where it is computed.
- :mod:`core.files`: checked reading of the files a user hands the harness.
- :mod:`core.corpus`: the text that installed packages ship (news, Wikipedia, GSM8K-free instructions).
- :mod:`core.pair`: the models of one run (``Pair``), as every method sees them.
"""
