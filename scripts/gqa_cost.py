"""What transformers' copy of the keys and values (``repeat_kv``) costs a verification, and what avoiding it saves.

  python scripts/gqa_cost.py [--shape llama-3.1-8b] [--contexts 256,1024,2048] [--rows 1,4,8,16]
      [--dtypes float32,bfloat16] [--repeats 15] [--layers 1] [--vocab 1024] [--forward-repeats 5] [--packed]
      [--no-forward] [--device cpu] [--threads N] [--csv PATH]

A GQA model's masked multi-row forward (every chain verification after a cache, every token tree) copies the
cache's keys and values ``heads / kv_heads`` times per layer in transformers' ``sdpa`` attention; ``ar``'s
one-row step reads them as they are (``core/gqa_attention.py`` says when each happens). For a synthetic shape
(``bench/synthetic.py``: heads, key/value heads, head size, widths) with random values, for every dtype,
context (cached tokens) and number of query rows k, under the harness clock (``core.clock``: the device
synchronised before each read), variants interleaved in every round, the first round dropped, medians in ms:

- attention of one layer alone, the mask a chain's causal one (as ``create_causal_mask`` builds it):
  ``repeat_kv`` (the copy of keys and values alone); ``sdpa`` (transformers' ``sdpa_attention_forward``: the
  copy, then SDPA); ``grouped`` (``core.gqa_attention``: query heads stacked along the rows, no copy);
  ``enable_gqa`` (SDPA's own ``enable_gqa=True`` with the mask); ``ar_row`` (one query row with no mask, as
  ``ar`` steps: ``enable_gqa``, no copy). ``sdpa_copies``: whether transformers' path copied here (one masked
  row: not from 5.24 on); ``copy_share``: ``repeat_kv`` / ``sdpa`` where it did; ``max_diff``: the largest
  difference between the ``sdpa`` and ``grouped`` outputs.
- unless ``--no-forward``: a whole forward of a ``--layers``-layer model of the shape (``--vocab`` rows of
  embedding and head: the shape's own 128k-row head would swamp one layer; 0 keeps it) after a cache of that
  context, k tokens with ``attn_implementation`` ``sdpa`` and ``sdpa_gqa``, per layer (the forward over the
  layers), and ``ar``'s one-token step (once per context); ``saved_share``: (``sdpa`` - ``sdpa_gqa``) / ``sdpa``,
  what the copy costs a verification forward; ``copy_of_layer``: ``repeat_kv`` over the per-layer ``sdpa`` forward.
  ``--packed``: the CPU fp32 linears packed as the harness packs them (``core.kernels``).

Prints a table; ``--csv PATH`` writes its rows. The defaults took 3 minutes on 2 busy CPU cores.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.synthetic import SHAPES  # noqa: E402
from core.clock import sync  # noqa: E402
from core.gqa_attention import grouped_sdpa_forward, register  # noqa: E402
from core.kv_cache import lm_forward  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timed(device: torch.device, variants: dict, repeats: int, before: dict | None = None) -> dict[str, float]:
    """Median ms of each of ``variants`` (name: a no-argument callable), run in turn ``repeats + 1`` times, the
    order rotated each round so none always runs first; the first round (warm-up) is dropped. ``before[name]``,
    when given, runs first, off the clock."""
    names, samples = list(variants), {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            if before and name in before:
                before[name]()
            sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                variants[name]()
            sync(device)
            if round_:
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def causal_mask(rows: int, context: int, device) -> torch.Tensor:
    """``(1, 1, rows, context + rows)`` boolean (True: attend): a chain of ``rows`` tokens after ``context``
    cached ones, what ``create_causal_mask`` gives ``sdpa`` for it."""
    keys = torch.arange(context + rows, device=device)
    return (keys[None, :] <= context + torch.arange(rows, device=device)[:, None])[None, None]


def attention_rows(shape: dict, dtype: torch.dtype, context: int, rows: int, repeats: int, device) -> dict:
    """One layer's attention at ``shape`` (a transformers config dict): the variants of the module docstring."""
    import transformers.integrations.sdpa_attention as sdpa_module
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape.get("head_dim") or shape["hidden_size"] // heads
    groups = heads // kv_heads
    module = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    kv = context + rows
    gen = torch.Generator(device=device).manual_seed(0)
    # As the model hands them over: queries a transposed view of (B, q, H, d), keys and values the cache's tensors.
    query = torch.randn(1, rows, heads, dim, generator=gen, device=device, dtype=dtype).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, kv, dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
    mask = causal_mask(rows, context, device)
    one = query[:, :, :1]
    scale = dim**-0.5
    variants = {
        "repeat_kv": lambda: (repeat_kv(key, groups), repeat_kv(value, groups)),
        "sdpa": lambda: sdpa_attention_forward(module, query, key, value, mask, scaling=scale),
        "grouped": lambda: grouped_sdpa_forward(module, query, key, value, mask, scaling=scale),
        "enable_gqa": lambda: torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2).contiguous(),
        "ar_row": lambda: sdpa_attention_forward(module, one, key[:, :, :context + 1], value[:, :, :context + 1],
                                                 None, scaling=scale),
    }
    ms = timed(device, variants, repeats)
    copied = []  # whether transformers' sdpa copies here (5.24 spares one masked row; 5.17 does not)
    sdpa_module.repeat_kv = lambda hidden, n_rep: copied.append(n_rep) or repeat_kv(hidden, n_rep)
    try:
        with torch.inference_mode():
            diff = (variants["sdpa"]()[0].float() - variants["grouped"]()[0].float()).abs().max().item()
    finally:
        sdpa_module.repeat_kv = repeat_kv
    return {**{f"attn_{k}_ms": v for k, v in ms.items()}, "sdpa_copies": bool(copied),
            "copy_share": ms["repeat_kv"] / ms["sdpa"] if copied else float("nan"), "max_diff": diff}


def build_model(shape_name: str, layers: int, vocab: int, dtype: torch.dtype, device, packed: bool):
    """A ``layers``-layer model of the shape with random weights (transformers' initialisation), on ``sdpa``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[shape_name]
    over = {"num_hidden_layers": layers, **({"vocab_size": vocab} if vocab else {})}
    config = AutoConfig.for_model(shape.family, **{**shape.config, **over})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    if packed and device.type == "cpu" and dtype == torch.float32:
        from core.kernels import pack_linears

        pack_linears(model)
    return model


def fill_cache(model, context: int, dtype: torch.dtype, device):
    """A ``DynamicCache`` holding ``context`` positions of random keys and values in every layer (the cost of a
    forward after it depends on its size, not its values; a prefill of thousands of tokens would take longer
    than the whole measurement)."""
    from transformers import DynamicCache

    c = model.config
    kv_heads = c.num_key_value_heads
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = DynamicCache()
    gen = torch.Generator(device=device).manual_seed(1)
    for layer in range(c.num_hidden_layers):
        k, v = (torch.randn(1, kv_heads, context, dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
        cache.update(k, v, layer)
    return cache


def forward_rows(model, cache, context: int, rows: int, repeats: int, device, ar: bool = True) -> dict:
    """Per-layer ms of a ``rows``-token forward after ``cache`` (``context`` positions) with ``sdpa`` and with
    ``sdpa_gqa``, and (``ar``) of ``ar``'s one-token step (the cache cropped back before each)."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(rows, device=device) * 7 + 3).remainder(vocab).unsqueeze(0)
    impls = {"sdpa": "sdpa", "sdpa_gqa": register(), **({"ar": "sdpa"} if ar else {})}
    tokens = {"sdpa": ids, "sdpa_gqa": ids, "ar": ids[:, :1]}

    def setup(impl: str):
        def run():  # off the clock: the cache back to `context` positions, the attention chosen
            extra = cache.get_seq_length() - context
            if extra:
                cache.crop(-extra)
            model.set_attn_implementation(impl)
        return run

    ms = timed(device, {name: (lambda name=name: lm_forward(model, tokens[name], cache, logits_to_keep=1))
                        for name in impls}, repeats, before={name: setup(impl) for name, impl in impls.items()})
    setup("sdpa")()
    layers = model.config.num_hidden_layers
    out = {"fwd_sdpa_ms": ms["sdpa"] / layers, "fwd_sdpa_gqa_ms": ms["sdpa_gqa"] / layers,
           "saved_share": (ms["sdpa"] - ms["sdpa_gqa"]) / ms["sdpa"]}
    return {**out, "fwd_ar_ms": ms["ar"] / layers} if ar else out


def main(argv: list[str]) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--contexts", default="256,1024,2048", help="cached tokens, comma-separated")
    p.add_argument("--rows", default="1,4,8,16", help="query rows k of the verification forward, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {sorted(DTYPES)}")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds of the attention variants")
    p.add_argument("--forward-repeats", type=int, default=5, help="timed rounds of the whole forwards")
    p.add_argument("--layers", type=int, default=1, help="layers of the model whose forward is timed")
    p.add_argument("--vocab", type=int, default=1024, help="its vocabulary (0: the shape's own)")
    p.add_argument("--packed", action="store_true", help="pack its CPU fp32 linears as the harness does")
    p.add_argument("--no-forward", action="store_true", help="time the attention alone")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: as torch sets them)")
    p.add_argument("--csv", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    contexts, rows_list = ints(args.contexts), ints(args.rows)
    bad = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if bad or min(contexts + rows_list) < 1 or args.repeats < 1 or args.forward_repeats < 1 or args.layers < 1:
        p.error(f"dtypes must be of {sorted(DTYPES)} (got {bad}); contexts, rows, repeats and layers at least 1.")
    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape].config
    if shape["num_attention_heads"] == shape["num_key_value_heads"]:
        p.error(f"{args.shape} has no grouped heads ({shape['num_attention_heads']} query and key/value heads).")
    out = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        model = (None if args.no_forward
                 else build_model(args.shape, args.layers, args.vocab, dtype, device, args.packed))
        for context in contexts:
            cache = None if model is None else fill_cache(model, context, dtype, device)
            ar_ms = None  # ar's step depends on the context only: timed with the first k
            for rows in rows_list:
                row = {"dtype": dname, "context": context, "rows": rows,
                       **attention_rows(shape, dtype, context, rows, args.repeats, device)}
                if model is not None:
                    row.update(forward_rows(model, cache, context, rows, args.forward_repeats, device,
                                            ar=ar_ms is None))
                    ar_ms = row["fwd_ar_ms"] = row.get("fwd_ar_ms", ar_ms)
                    row["copy_of_layer"] = (row["attn_repeat_kv_ms"] / row["fwd_sdpa_ms"] if row["sdpa_copies"]
                                            else float("nan"))
                out.append(row)
                print(f"{dname} context {context} rows {rows}: done", file=sys.stderr, flush=True)
        del model
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    print(f"{args.shape}: {heads} query heads, {kv_heads} key/value heads; {torch.get_num_threads()} threads, "
          f"{device}, torch {torch.__version__}; ms (medians), forward columns per layer")
    print(tabulate(out, headers="keys", floatfmt=".3g"))
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(out[0]))
            writer.writeheader()
            writer.writerows(out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
