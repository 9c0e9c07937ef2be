"""Decoding methods, one per file. Adding a new method:

1. Write ``methods/<name>.py`` with a subclass of :class:`methods.base.Method` decorated with
   ``@register("<name>")``; implement ``decode`` (and ``setup`` if it needs trained parts).
2. Add ``configs/method/<name>.yaml`` with ``name: <name>`` and the method's settings.
3. Add a greedy-equality test against ``ar`` in ``tests/`` if the method is lossless.

Nothing in ``bench/`` changes: the harness discovers the file, times it, counts its model calls and writes
its records.
"""
