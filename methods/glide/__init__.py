"""The GliDe family: a draft that attends to the target's own KV cache (glimpse), with CaPE's proposal expansion.

``glide`` is the method; its internals: the draft and its trainer (``_draft.py``) and the authors' published drafter
read in their layout (``_published.py``)."""
