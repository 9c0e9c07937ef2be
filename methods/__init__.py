"""Decoding methods, one per file. Adding a new method (the README's "Adding a method" has a full example):

1. Write ``methods/<name>.py`` with a subclass of :class:`methods.base.DraftVerify` decorated with
   ``@register("<name>")``; implement ``propose`` (and ``setup``, ``start``, ``accepted``, ``extra``,
   ``check_pair`` or a lossy ``verify`` where the method needs them).
2. Declare its settings in the same file: a nested ``class Config(MethodSettings)`` whose fields carry type,
   range, default and meaning (``Field(4, ge=1, description=...)``). ``method=<name>`` composes them (Hydra's
   ConfigStore), ``python -m bench show method=<name>`` prints them, bad values are refused in one sentence.
3. A method that trains a part from the target also says so: ``has_trained_parts`` (records then name the run's
   recipe and run keys include it), ``check_recipe`` for rules against the recipe, and loads the part in ``setup``
   through ``training.kit.untrained_if_synthetic`` (the part's cached artifact, or an untrained one on a synthetic
   pair). ``tests/methods/test_contract.py`` fails a setup that reads a recipe-keyed artifact without saying so.

Nothing in ``bench/`` or ``configs/`` changes and no test needs writing: the harness discovers the file, times
it, counts its model calls and writes its records, ``tests/methods/test_methods.py`` walks the registry (greedy
equality with ``ar`` and the sampling distribution test for every lossless method) and
``tests/bench/test_schema.py`` walks its settings (wrong type, out of range, NaN). Files whose name starts with an
underscore hold a family's internals and are not registered.
"""
