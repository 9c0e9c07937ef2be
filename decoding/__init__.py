"""Parts that decoding methods share, apart from the harness that runs and measures them.

- :mod:`decoding.sampling`: temperature / top-p distributions and draws.
- :mod:`decoding.verify`: the lossless verifiers (a chain: Leviathan et al.; a tree: recursive rejection sampling).
- :mod:`decoding.tree`: the one token tree (tree attention mask, scoring in one forward, keeping a path's cache).
- :mod:`decoding.ngram`: n-gram stores (the text's own n-grams, corpus continuation and bigram tables).
- :mod:`decoding.corpus`: text that packages ship, for training and statistics.
- :mod:`decoding.training`: the training loop and teacher-forced target labels shared by trained drafters.
- :mod:`decoding.distill`: the draft model the harness distils from a target.

Nothing here times, counts or writes results: that is the harness's job (:mod:`bench`).
"""
