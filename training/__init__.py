"""Training the parts that methods learn from the target: nothing here decodes, times or counts.

- :mod:`training.teacher`: the teacher store (the target's labels of packaged text and of its own answers), the
  recipes (``quick``, ``full``, ``smoke``) and ``Teacher``, what every trainer of a run reads.
- :mod:`training.loop`: the one training loop (``fit``) and the settings every trainer shares.
- :mod:`training.distill`: the draft model the harness distils from a target.
"""
