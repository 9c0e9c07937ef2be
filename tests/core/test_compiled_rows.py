"""core/compiled_rows.py: a method's cache-free parts (draft heads, SPRINTER's verifier) compiled per bucket of rows.
Padding to a bucket changes no real row, is counted as padding, and a call the graphs do not hold runs eagerly and is
counted so; a compiled part whose outputs are not the eager module's is refused before any clock."""

import gc

import pytest
import torch
from torch import nn

from core.compiled import no_recompiles
from core.compiled_rows import CompiledRows, row_buckets
from core.counting import CountedModule
from core.errors import BenchError


class TwoInputs(nn.Module):
    """Rows on their own: ``(n, 8), (n, 2, 8) -> (n, 5)``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16 + 16, 5)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.b(torch.cat([nn.functional.silu(self.a(x)), extra.flatten(-2)], -1))


@pytest.fixture(scope="module")
def part():
    torch.manual_seed(0)
    module = TwoInputs().eval()
    counted = CountedModule(module, "heads")
    counted.compiled = CompiledRows(module, {((8,), (2, 8)): (1, 2, 4)}, "heads")
    counted.compiled.warm()
    counted.compiled.check()
    return counted


def test_padding_changes_no_row_and_is_counted(part):
    part.reset()
    with torch.inference_mode(), no_recompiles():  # as the harness decodes (the graphs guard on it)
        x, extra = torch.randn(3, 8), torch.randn(3, 2, 8)
        got = part(x, extra)
        alone = part(x[1:2], extra[1:2])
        ref = part.module(x, extra)
    assert got.shape == (3, 5) and torch.allclose(got, ref, atol=1e-5) and torch.allclose(alone[0], ref[1], atol=1e-5)
    # 3 rows ran in the 4-row graph: one padding row, costing what a real row costs; 1 row in the 1-row graph.
    assert part.calls == 2 and part.tokens == 4 and part.padded_tokens == 1
    assert part.padded_flops == pytest.approx(part.flops / 4) and part.uncompiled_calls == 0


def test_a_call_the_graphs_do_not_hold_runs_eagerly_and_is_counted(part):
    part.reset()
    with torch.inference_mode(), no_recompiles():
        beyond = part(torch.randn(5, 8), torch.randn(5, 2, 8))  # more rows than the largest bucket
    assert beyond.shape == (5, 5) and part.uncompiled_calls == 1 and part.padded_tokens == 0


def test_a_batch_stacks_its_rows_into_one_compiled_call(part):
    part.reset()
    with torch.inference_mode(), no_recompiles():
        rows = [{"args": (torch.randn(1, 8), torch.randn(1, 2, 8))}, None,
                {"args": (torch.randn(2, 8), torch.randn(2, 2, 8))}]
        outs, shares = part.forward_rows(rows)
        ref = part.module(*rows[2]["args"])
    assert outs[1] is None and shares[1] is None and torch.allclose(outs[2], ref, atol=1e-5)
    # One stacked call of 3 rows, padded to 4: the padding row shared by the two rows that made the call.
    assert part.padded_tokens == 1 and shares[0]["padded_tokens"] + shares[2]["padded_tokens"] == pytest.approx(1)


def test_a_miscompiled_part_is_refused():
    module = TwoInputs().eval()
    compiled = CompiledRows(module, {((8,), (2, 8)): (1, 2)}, "heads")
    compiled.warm()
    compiled.graph = lambda x, extra: module(x, extra) + 1.0  # what a compiler bug would return
    with pytest.raises(BenchError, match="the compiled forward of the heads is 1 away from the eager one"):
        compiled.check()


def test_row_buckets_reach_the_most_rows_a_call_holds():
    assert [row_buckets(n) for n in (1, 2, 3, 4, 5, 9)] == [(1,), (1, 2), (1, 2, 4), (1, 2, 4), (1, 2, 4, 8),
                                                          (1, 2, 4, 8, 16)]


def test_release_lets_go_of_the_code_inductor_generated():
    """The generated modules hold a frozen graph's weights, and inductor keeps them for the life of the process: a
    released part drops its own, and its graphs' entries in dynamo. A sweep's jobs each compile their own parts of the
    same class: five jobs of two graphs each, past dynamo's recompile limit (8) without the release, all compile."""
    from torch._inductor.codecache import PyCodeCache

    for _ in range(5):
        # Modules held in a container, as heads are (their ModuleLists): dynamo guards on each one's identity.
        module = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 5)).eval()
        compiled = CompiledRows(module, {((8,),): (1, 2)}, "heads")
        compiled.warm()
        compiled.check()
        code = list(compiled.code)
        assert code and all(any(mod is c for mod in PyCodeCache.modules) for c in code)
        compiled.release()
        assert not any(mod is c for mod in PyCodeCache.modules for c in code) and compiled.graph is None
        del compiled, code, module  # the job ends: its module dies (dynamo counts a dead module's entries as the next one's)
        gc.collect()
