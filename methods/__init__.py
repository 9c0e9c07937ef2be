"""Decoding methods, one per file. Adding a new method (the README's "Adding a method" has a full example):

1. Write ``methods/<name>.py`` with a subclass of :class:`methods.base.DraftVerify` decorated with
   ``@register("<name>")``; implement ``propose`` (and ``check``, ``setup``, ``start``, ``accepted``,
   ``figures`` or a lossy ``verify`` where the method needs them).
2. Add ``configs/method/<name>.yaml`` with ``name: <name>`` and the method's settings.

Nothing in ``bench/`` changes and no test needs writing: the harness discovers the file, times it, counts
its model calls and writes its records, and ``tests/test_methods.py`` walks the registry (greedy equality
with ``ar`` and the sampling distribution test for every lossless method). Files whose name starts with an
underscore hold a family's internals and are not registered.
"""
