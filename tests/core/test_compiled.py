"""The compiled target (core/compiled.py): per-bucket graphs over a static per-row cache give the eager model's
logits and hidden states, count their padding, never compile inside a decode, and refuse what they cannot run
(a hook on the target, a forward that bypasses them, a second decode on their cache, a graph that ignores it)."""

import pytest
import torch
from transformers import DynamicCache

from core.compiled import CompiledLM, bucket_for, compiled_batch_sizes, no_recompiles
from core.counting import CountedLM
from core.errors import BenchError
from core.kv_cache import lm_forward
from decoding.tree import Tree, score_tree
from tests.helpers import decode, prompts_for


def random_tree(gen: torch.Generator, n: int, vocab: int) -> Tree:
    tree = Tree(int(torch.randint(vocab, (1,), generator=gen)))
    for _ in range(n - 1):
        parent = int(torch.randint(len(tree), (1,), generator=gen))
        tree.add_child(parent, int(torch.randint(vocab, (1,), generator=gen)), merge=False)
    return tree


@pytest.mark.parametrize("size", [1, 3, 4, 13, 40, 70])  # buckets 1, 4, 4, 16, 64; 70: beyond them, uncompiled
def test_a_tree_forward_gives_the_eager_logits_and_hidden_states(tiny_pair, compiled, size):
    pair = compiled(tiny_pair)
    eager = CountedLM(tiny_pair.target.module, "target")
    gen = torch.Generator().manual_seed(size)
    vocab = tiny_pair.target.module.config.vocab_size
    prompt = torch.randint(vocab, (1, 20), generator=gen)
    with torch.inference_mode(), no_recompiles():
        cache, ref_cache = pair.target.new_cache("test"), DynamicCache()
        for counted, c in ((pair.target, cache), (eager, ref_cache)):
            counted(prompt, c)
        for step in range(3):  # trees after a growing cache, each kept in part as a decode keeps it
            tree = random_tree(gen, size, vocab)
            got, got_h = score_tree(pair.target, cache, tree, hidden=True)
            ref, ref_h = score_tree(eager, ref_cache, tree, hidden=True)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_h, ref_h, rtol=1e-4, atol=1e-4)
            for c in (cache, ref_cache):
                c.crop(-(size - 1))  # keep the root only
    assert pair.target.uncompiled_calls == (3 if size > 64 else 0)  # the 20-token prefill runs bucket 32



def test_a_level_of_a_tree_read_after_its_cousins_gives_the_eager_logits(tiny_pair, compiled):
    """How a draft reads a tree level by level (decoding.tree.nodes_request; spechub, gsd): the cached nodes of earlier
    levels that are not a node's ancestors are hidden from it, which the compiled forward's mask keeps hidden."""
    from decoding.tree import nodes_request

    pair = compiled(tiny_pair)
    eager = CountedLM(tiny_pair.target.module, "target")
    gen = torch.Generator().manual_seed(3)
    vocab = tiny_pair.target.module.config.vocab_size
    prompt = torch.randint(vocab, (1, 12), generator=gen)
    tree = Tree(int(prompt[0, -1]))
    for parent in (0, 0, 0, 1, 2, 3, 3):  # root; three children; one or two grandchildren each
        tree.add_child(parent, int(torch.randint(vocab, (1,), generator=gen)), merge=False)
    with torch.inference_mode(), no_recompiles():
        got, ref = [], []
        for counted, cache, out in ((pair.target, pair.target.new_cache("test"), got), (eager, DynamicCache(), ref)):
            counted(prompt, cache)  # the text up to the pending token, the tree's root
            for level, cached in (([1, 2, 3], []), ([4, 5, 6, 7], [1, 2, 3])):
                request = nodes_request(counted, cache, tree, level, cached, prompt.shape[1] - 1)
                out.append(request.pop("lm")(**request).logits[0])
    assert pair.target.uncompiled_calls == 0
    torch.testing.assert_close(torch.cat(got), torch.cat(ref), rtol=1e-4, atol=1e-4)

def test_padding_rows_are_counted_not_hidden(tiny_pair, compiled, compiled_lm):
    pair = compiled(tiny_pair)
    ids = prompts_for(tiny_pair, 3)[2][:30]
    with no_recompiles():
        pair.reset_counts()
        ar = decode(pair, "ar", ids, max_new=10)
        plain = pair.target.stats()
        pair.reset_counts()
        sd = decode(pair, "sd", ids, max_new=10, gamma=2)
        chains = pair.target.stats()
    assert ar.output_ids == sd.output_ids
    buckets = compiled_lm.buckets
    assert plain["padded_tokens"] == bucket_for(30, buckets) - 30  # steps of 1 row: no padding
    assert plain["padded_flops"] > 0  # every row attends over the whole static cache
    assert sd.drafted.count(2) >= 2  # chains of 3 rows, one padding row each
    assert chains["padded_tokens"] == bucket_for(30, buckets) - 30 + sum(bucket_for(d + 1, buckets) - (d + 1) for d in sd.drafted)
    assert chains["uncompiled_calls"] == 0


def test_a_hook_on_the_target_is_refused(tiny_pair, compiled):
    pair = compiled(tiny_pair)
    handle = tiny_pair.target.module.get_input_embeddings().register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(BenchError, match="hook on the target's Embedding would not run"):
            decode(pair, "ar", prompts_for(tiny_pair, 1)[0][:10], max_new=3)
    finally:
        handle.remove()


def test_a_second_compiled_lm_of_the_model_leaves_the_firsts_graphs_valid(tiny_pair, compiled_lm, compiled):
    """The layer recorder is the model's, shared: a second CompiledLM of the same module (a sweep's next job, a test's
    wrapper, a deep copy of the model) adds no hook, so the first's graphs pass their guards without compiling again
    (dynamo guards on a module's hook count: per-wrapper hooks made a CI run hit the recompile limit)."""
    import copy

    layers = list(tiny_pair.target.module.model.layers)
    hooks = [len(layer._forward_pre_hooks) for layer in layers]
    CompiledLM(tiny_pair.target.module, 64, (1, 2))
    assert [len(layer._forward_pre_hooks) for layer in layers] == hooks
    twin = copy.deepcopy(tiny_pair.target.module)
    assert CompiledLM(twin, 64, (1,)).recorder is not compiled_lm.recorder  # a copy records into its own
    pair = compiled(tiny_pair)
    with no_recompiles():
        decode(pair, "ar", prompts_for(tiny_pair, 1)[0][:10], max_new=3)


def test_the_cache_is_written_by_the_compiled_forwards_only(tiny_pair, compiled_lm, compiled):
    cache = compiled_lm.new_cache("test")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="written by its compiled model's own forwards"):
        lm_forward(tiny_pair.target.module, torch.tensor([[1, 2, 3]]), cache)


def test_one_decode_holds_the_cache_at_a_time(compiled_lm, compiled):
    compiled_lm.new_cache("sd")
    with pytest.raises(BenchError, match="while sd holds it"):
        compiled_lm.new_cache("ar")
    compiled_lm.release()
    compiled_lm.new_cache("ar")


def test_a_cache_too_small_for_a_forward_is_one_sentence(tiny_pair, compiled):
    pair = compiled(tiny_pair)
    with torch.inference_mode(), pytest.raises(BenchError, match="passes the compiled target's cache"):
        pair.target(torch.zeros(1, 2000, dtype=torch.long), pair.target.new_cache("test"))


class ForgetfulTarget(CompiledLM):
    """A compiled target whose graph reads its new rows without the cache: what a model that swallows the cache
    keyword, or a stale frozen graph, would compute."""

    def _hidden(self, ids, depth, visible, swapped, fill, cross=None):
        self.cache.lengths_t.zero_()
        return super()._hidden(ids, depth, visible, swapped, fill, cross)


def test_a_compiled_lm_that_ignores_its_cache_is_refused(tiny_pair):
    target = ForgetfulTarget(tiny_pair.target.module, max_len=64, buckets=(1,))
    target.warm()
    with pytest.raises(BenchError, match="compiled target's logits are .* away from the eager model's"):
        target.check()


def test_the_compiled_lm_passes_its_check(compiled_lm, compiled):
    compiled_lm.check()


@pytest.mark.parametrize("name", ["sd", "pld"])
def test_sampling_through_the_compiled_forwards_draws_what_eager_draws(tiny_pair, compiled, name):
    """Sampling reads the same logits (up to rounding), so with the same seed a compiled decode draws the eager one's
    tokens: the compiled path changes nothing but the time (the distribution tests run eagerly in test_methods)."""
    pair = compiled(tiny_pair)
    ids = prompts_for(tiny_pair, 8)[5]
    with no_recompiles():
        for seed in (1, 2):
            got = decode(pair, name, ids, max_new=20, temperature=0.8, seed=seed)
            ref = decode(tiny_pair, name, ids, max_new=20, temperature=0.8, seed=seed)
            assert got.output_ids == ref.output_ids and got.accept_lengths == ref.accept_lengths


def test_no_cpp_compiler_is_one_sentence(monkeypatch):
    """compile=true on a CPU without a C++ compiler: inductor cannot build its kernels; said before anything loads."""
    from torch._inductor import cpp_builder

    from core.compiled import check_compiler

    def missing():
        raise RuntimeError("Failed to find C++ compiler. Please specify via CXX environment variable.")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    with pytest.raises(BenchError, match="needs a C\\+\\+ compiler for torch inductor.*set compile=false"):
        check_compiler(torch.device("cpu"))
    with pytest.raises(BenchError, match="compile=true runs on the CPU or on CUDA"):
        check_compiler(torch.device("mps"))


def test_a_distilled_draft_compiles_with_its_reduced_vocabulary(tiny_pair):
    """A distilled draft (training.distill.DraftLM) scores a reduced vocabulary, -inf elsewhere: its compiled forwards
    give the same logits (the same -inf entries), and its check passes."""
    from training.distill import draft_from_target

    target = tiny_pair.target.module
    draft = draft_from_target(target, [0], torch.arange(0, target.config.vocab_size, 3)).eval()
    graphs = CompiledLM(draft, max_len=64, buckets=(4,), role="draft")
    graphs.warm()
    graphs.check()
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.inference_mode(), no_recompiles():
        ref = lm_forward(draft, ids).logits[0]
        got = graphs(ids, graphs.new_cache("test"), logits_to_keep=3).logits[0]
    graphs.release()
    assert torch.equal(got.isinf(), ref[-3:].isinf()) and int(got.isinf().sum()) > 0
    torch.testing.assert_close(got[got.isfinite()], ref[-3:][got.isfinite()], rtol=1e-4, atol=1e-4)


def test_a_prefill_longer_than_the_largest_bucket_runs_row_by_row_unpadded(tiny_pair):
    """A batch forward past the largest bucket (prompts' prefills, uncompiled) runs each real row on its own slice of
    the cache: no row is padded to the longest (``ran``: each row's width is its own), an idle row costs nothing, and
    each row's logits are its prompt's read alone; the next forward, within the buckets, reads every row at once."""
    from core.kv_cache import lm_forward

    module = tiny_pair.target.module
    graphs = CompiledLM(module, max_len=256, buckets=(1, 4), rows=3, compiled=False)
    ids = torch.arange(3, 60).remainder(module.config.vocab_size)
    prompts = [ids[:30], None, ids[5:14]]
    with torch.inference_mode():
        outs = graphs.forward_rows([{"input_ids": p[None]} if p is not None else None for p in prompts])
        assert [r[1:3] for r in graphs.ran] == [(30, 30), (0, 0), (9, 9)]
        assert graphs.cache.lengths == [30, 0, 9]
        for p, out in zip(prompts, outs):
            if p is not None:
                assert torch.allclose(out.logits[0], lm_forward(module, p[None]).logits[0], atol=1e-4)
        steps = graphs.forward_rows([{"input_ids": ids[None, :1]}, None, {"input_ids": ids[None, :1]}])
        assert graphs.ran[0][2] == graphs.ran[2][2] == 1  # one forward of all rows
        for p, out in zip(prompts, steps):
            if p is not None:
                whole = lm_forward(module, torch.cat([p, ids[:1]])[None]).logits[0, -1]
                assert torch.allclose(out.logits[0, -1], whole, atol=1e-4)


@pytest.mark.parametrize("rows, asked, device, sizes", [
    (1, None, "cuda", (1,)), (8, None, "cuda", (1, 2, 4, 8)), (6, None, "cuda", (1, 2, 4, 6)), (8, None, "cpu", (8,)),
    (8, (3, 16), "cpu", (3, 8)), (8, (), "cuda", (8,))])
def test_a_batch_compiles_graphs_for_the_batch_sizes_below_it(rows, asked, device, sizes):
    """The running-row counts a compiled batch has graphs for (``compile_batch_sizes``): by default the powers of two
    below it on CUDA, none on the CPU (each graph a frozen copy of the weights there), what is asked below it
    otherwise, and itself always."""
    assert compiled_batch_sizes(rows, asked, torch.device(device)) == sizes
