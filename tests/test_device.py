"""Device discipline, checked without a GPU: every tensor a method's decode creates names its device.

On CUDA a tensor created without ``device=`` lands on the CPU, and the first operation mixing it with the
model's tensors fails (or, for an index, silently copies every step). Here the models stay on the CPU while
the default device is ``meta`` for the decode: a tensor created on the implicit device is a meta tensor, which
fails the moment it meets real data, just as a stray CPU tensor would meet CUDA ones. Host-side bookkeeping
(token trees, plans) says ``device="cpu"`` to be exempt, and moves to the model's device where it is used.

The same walk on a real GPU, with numbers, is ``tests/test_gpu.py`` (marked ``gpu``).
"""

import pytest
import torch

from methods.registry import get_method, known_methods
from tests.helpers import build, prompts_for, run


@pytest.fixture(scope="module")
def prompt(tiny_pair):
    return prompts_for(tiny_pair, 1)[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", known_methods())
def test_decode_creates_no_tensor_on_an_implicit_device(name, temperature, tiny_pair, prompt):
    method = build(tiny_pair, name)
    torch.set_default_device("meta")
    try:
        out = run(method, prompt, 12, temperature)
    finally:
        torch.set_default_device(None)
    assert 0 < len(out.output_ids) <= 12


def test_the_probe_catches_a_tensor_on_the_implicit_device(tiny_pair, prompt):
    """A method that builds its draft ids without ``device=`` fails under the probe (the probe can fail)."""
    from methods.pld import PLD

    class Careless(PLD):
        def propose(self, state):
            proposal = super().propose(state)
            torch.tensor(proposal.tree.tokens).to(state.device)  # the implicit device: meta here, the CPU beside CUDA
            return proposal

    method = Careless(get_method("pld").settings({}), tiny_pair)
    method.setup()
    torch.set_default_device("meta")
    try:
        with pytest.raises(NotImplementedError, match="meta"):
            run(method, prompt, 12)
    finally:
        torch.set_default_device(None)
