"""The EAGLE family: a draft layer that predicts the target's next hidden state from its last one and the token.

``eagle`` (EAGLE-1's static tree, EAGLE-2's dynamic tree) and ``eagle3`` (EAGLE-3's fused low/mid/high features and
training-time test) are the methods; their internals: the draft and its trainer (``_draft.py``, ``_draft3.py``) and
the authors' published drafters read in their own layouts (``_published.py``, ``_published3.py``). KOALA's and
SAMD's EAGLE modes build on ``eagle`` (``methods/heads/koala.py``, ``methods/samd.py``)."""
