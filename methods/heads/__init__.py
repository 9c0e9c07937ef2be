"""Draft heads on the target's hidden states, one family: Medusa (``medusa.py``), Hydra and Hydra++ (``hydra.py``),
KOALA (``koala.py``: deeper heads or EAGLE's draft, trained adversarially) and Amphista (``amphista.py``).

Internals: the heads' modules (``_heads.py``), their training and cache (``_train.py``), the decoding loop they
share (``_tree_heads.py``), the authors' published heads (``_published.py``), Amphista's adaptation layers
(``_amphista.py``). KOALA's discriminator is ``training/adversarial.py``, which KOALA's EAGLE draft reads too."""
