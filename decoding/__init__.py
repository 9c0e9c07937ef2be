"""Parts that decoding methods share, apart from the harness that runs and measures them.

- :mod:`decoding.sampling`: temperature / top-p distributions and draws.
- :mod:`decoding.verify`: the lossless verifiers (a chain: Leviathan et al.; a tree: recursive rejection sampling).
- :mod:`decoding.tree`: the one token tree (tree attention mask, scoring in one forward, keeping a path's cache).
- :mod:`decoding.ngram`: n-gram stores (the text's own n-grams, corpus continuation and bigram tables).
- :mod:`decoding.cache`: rolling a KV cache back after a rejection.

Nothing here times, counts or writes results: that is the harness's job (:mod:`bench`).
"""
