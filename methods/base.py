"""The one decode interface every method implements, and the loop every draft-and-verify method shares.

- :class:`Method`: what the harness calls (``setup``, ``decode``) and reads (``lossless``, ``drafts``,
  ``is_lossless``, ``analytic_speedup``).
- :class:`DraftVerify`: the loop of every draft-and-verify method: prefill, then per step ONE target forward
  over what the method proposes, verification, commit (:meth:`~DraftVerify.steps`, a generator of those forwards,
  which :meth:`~DraftVerify.decode` runs for one prompt and :meth:`~DraftVerify.decode_batch` for several at once). A subclass says only what is its own:
  :meth:`~DraftVerify.propose` (and optionally :meth:`~DraftVerify.start`, :meth:`~DraftVerify.verify`,
  :meth:`~DraftVerify.accepted`, :meth:`~DraftVerify.extra`, and :meth:`~DraftVerify.side_scored` for rows the
  forward reads beside the candidates).
- :class:`PromptState`: one prompt's state, which the loop owns: the committed text, the target's KV cache (and
  any cache a method registers with :meth:`~PromptState.track`), the token budget and the stop at EOS.

Invariant after every commit: each tracked cache holds at most the committed text minus its last token (the
pending one, fed with the next step's proposal), so a rejected proposal is dropped, never recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from pydantic import Field, field_validator, model_validator
from transformers import DynamicCache

from core.errors import BenchError
from core.pair import Pair
from core.schema import Settings, as_config, check
from core.static_cache import RowView
from core.swapped_embeddings import swapped_embeddings
from decoding.cache import truncate_cache
from decoding.sampling import Sampling, next_token
from decoding.tree import SideRows, Tree, keep_path, tree_request, tree_scores
from decoding.verify import verify_chain, verify_tree


def deep_merge(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s values in place of its own, nested dicts merged key by key (a nested method's)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class MethodSettings(Settings):
    """A method's settings (``method.*``); each method declares its own as a subclass, ``Config``, in its file."""

    # Set by method=<name>, or by the enclosing method for one nested in another's settings: `show` lists it not.
    name: str = Field("", description="the method, as registered (method=<name> sets it)",
                      json_schema_extra={"shown": False})
    by_batch: dict[int, dict[str, Any]] | None = Field(
        None, description="settings by batch size, {B: {setting: value, ...}, ...}: at batch_size B and above (to the "
        "next B listed) they replace the others, as vLLM's num_speculative_tokens_per_batch_size (the best draft "
        "length shrinks as the batch grows: docs/batching.md); e.g. {4: {gamma: 3}, 8: {gamma: 2}}",
        # A nested method's is refused (the run's method's entries set it); listed after the method's own settings.
        json_schema_extra={"nested": False, "listed": "last"})

    @field_validator("by_batch", mode="before")
    @classmethod
    def batch_sizes_as_read(cls, value):
        """JSON (a record's settings, these settings dumped) writes the batch sizes as text."""
        if isinstance(value, dict):
            return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def batch_sizes(self):
        if any(b < 1 for b in self.by_batch or {}):
            raise ValueError(f"by_batch's keys are batch sizes, integers >= 1; got {sorted(self.by_batch)}.")
        return self

    def at_batch(self, batch_size: int) -> MethodSettings:
        """These settings as a run at ``batch_size`` reads them: the :attr:`by_batch` entry of the largest B listed
        that is at most ``batch_size`` over the others (none listed: these), checked as any settings are."""
        listed = [b for b in sorted(self.by_batch or {}) if b <= batch_size]
        return self.with_entry(listed[-1]) if listed else self

    def with_entry(self, b: int) -> MethodSettings:
        """These settings with :attr:`by_batch`'s entry for batch size ``b`` over them; one sentence on a bad entry."""
        where = f"method.by_batch.{b}"
        entry = self.by_batch[b]
        if not isinstance(entry, dict) or {"name", "by_batch"} & set(entry):
            raise BenchError(f"{where} must map settings of {self.name or 'the method'} to their values at that batch "
                             f"size, not name or by_batch; got {entry!r}.")
        data = deep_merge(self.model_dump(mode="json", exclude={"by_batch"}), entry)
        return check(type(self), {**data, "by_batch": self.by_batch}, where)


@dataclass
class DecodeOutput:
    """What one decode returns; timings and model calls are added by the harness, not by the method.

    ``output_ids``: the new tokens only (prompt excluded), at most ``max_new_tokens``.
    ``accept_lengths``: tokens committed by each target call after the prefill (bonus token counted, so
    plain decoding gives 1 per call).
    ``drafted``: tokens proposed along the deepest path at each of those calls (0 for plain decoding); with
    ``accept_lengths`` it gives the acceptance rate per draft position.
    ``extra``: method-specific per-prompt figures (tree size, per-level hits, ...), JSON-able.
    """

    output_ids: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    # A row of a batch (DraftVerify.decode_batch): its share of every role's counts (role -> Counted.stats() keys);
    # None for a decode alone, whose counts the harness reads from the pair.
    counts: dict | None = None


class Method:
    """Base class. A method proposes and verifies tokens; it never times, counts or writes anything.

    Subclasses set ``lossless`` (True when greedy output must equal ``ar`` token for token and sampled output
    follow the target's distribution) and ``drafts`` (how many of the pair's draft models they run; a run
    loads and trains only those).
    """

    name: str = "?"
    lossless: bool = True
    drafts: int = 0
    Config: type[MethodSettings] = MethodSettings  # its settings: types, ranges, defaults, meanings
    label_settings: tuple[str, ...] = ()  # settings its rows in tables always name (beside those that vary)
    train_variants: tuple[dict, ...] = ({},)  # the settings ``train all`` trains it with (over its defaults)
    # Why it cannot decode a batch (batch_size > 1) yet, in a few words; None: it can (DraftVerify's shared loop).
    batch_refusal: str | None = "it decodes with a loop of its own, which a batch does not run yet"

    def __init__(self, cfg: MethodSettings | DictConfig | dict, pair: Pair):
        self.cfg = self.check_settings(cfg)  # typed: validated, defaults filled in, as the command line checks
        self.pair = pair

    @classmethod
    def check_settings(cls, cfg: MethodSettings | DictConfig | dict) -> MethodSettings:
        """``cfg`` (the ``method`` node, or part of it) checked against :attr:`Config`, defaults filled in."""
        if isinstance(cfg, DictConfig):
            data = OmegaConf.to_container(cfg, resolve=True)
        else:
            data = cfg.model_dump(mode="json") if isinstance(cfg, Settings) else dict(cfg)
        data.setdefault("name", cls.name)
        settings = check(cls.Config, data, "method", f"method={cls.name}")
        for b in settings.by_batch or {}:
            settings.with_entry(b)  # each entry checked once, with the settings it makes
        for key, value in settings:
            if isinstance(value, MethodSettings) and value.by_batch is not None:
                raise BenchError(f"method.{key}.by_batch is read from the run's method only: set method.by_batch="
                                 f"{{B: {{{key}: {{...}}}}}} instead.")
        return settings

    @classmethod
    def check_pair(cls, settings: MethodSettings, pair) -> None:
        """Rules between the method's settings and the pair's (``bench.models.PairSettings``), before any model
        loads: by default, a method that runs a draft needs a pair with one. One sentence on a problem."""
        if cls.drafts and not pair.drafts:
            raise BenchError(f"method={cls.name} runs a draft model but pair={pair.name} has none.")

    @classmethod
    def settings(cls, cfg: DictConfig | dict) -> DictConfig:
        """:meth:`check_settings` as the ``DictConfig`` the method reads."""
        return as_config(cls.check_settings(cfg))

    @classmethod
    def variants(cls) -> list[tuple[str, DictConfig]]:
        """``(label, settings)`` of each variant ``train all`` trains (:attr:`train_variants` over the defaults):
        the method's name for its defaults, ``koala (base=medusa)`` for one that sets something."""
        return [(f"{cls.name} ({', '.join(f'{k}={v}' for k, v in over.items())})" if over else cls.name,
                 cls.check_settings(over)) for over in cls.train_variants]

    def setup(self, train_if_missing: bool = True) -> None:
        """Load (or build, when missing) what the method needs beyond the pair: heads, verifier, tables."""

    def batch_parts(self) -> list:
        """Models of the method's own with a KV cache (``CountedLM``s, after :meth:`setup`) whose forwards it yields
        when their cache is a static one (a ``RowView``), so that a batch runs them on a batch cache of their own like
        a draft model's (EAGLE's draft layer; ``bench.runner.batch_models``), and ``compile=true`` compiles them for one
        prompt at a time too (``bench.runner.compile_parts``: the prompt's forwards then run as a batch of one)."""
        return []

    def row_parts(self, batch: int) -> list[tuple]:
        """The method's cache-free parts that ``compile=true`` compiles per bucket of rows (after :meth:`setup`; draft
        heads, :class:`core.counting.CountedModule`s whose rows are independent): ``(part, {signature: rows})`` each,
        per input shapes beyond dim 0 its calls use (``core.compiled_rows.Signature``) the most rows one such call
        holds with ``batch`` prompts decoding (a batch stacks every row's call into one). None by default."""
        return []

    @classmethod
    def trains(cls, pair_spec, settings=None) -> bool:
        """Whether the method runs anything trained under the run's recipe on a pair of ``pair_spec``: its records
        then name the recipe, and its run keys (resume) include it. Never on a synthetic pair (``pair.acceptance``
        set), which runs the method's trained parts untrained (:func:`training.kit.untrained_if_synthetic`): its
        records name no recipe. Otherwise :meth:`has_trained_parts`."""
        return pair_spec.get("acceptance") is None and cls.has_trained_parts(pair_spec, settings)

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        """Whether the method reads a part trained from the target on a pair of ``pair_spec`` (a distilled draft;
        subclasses with heads or a verifier say so). ``settings``: the method's checked settings, when known (a
        method reading the authors' published weights trains nothing)."""
        return any(spec.source == "distilled" for spec in list(pair_spec.get("drafts") or [])[: cls.drafts])

    @classmethod
    def check_recipe(cls, settings: MethodSettings, recipe) -> None:
        """Rules between the method's settings and the run's training recipe, before any model loads."""

    def is_lossless(self, sampling: Sampling) -> bool:
        """Whether this instance's output is exactly the target's under ``sampling`` (what records say)."""
        return self.lossless

    @classmethod
    def analytic_speedup(cls, alpha: float, gamma: float, c: float) -> float:
        """The method's own analytic speedup model from the measured per-token acceptance ``alpha``, mean
        tokens drafted per target call ``gamma`` and draft/target cost ratio ``c``; NaN: it states none."""
        return float("nan")

    def decode(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling,
        generator: torch.Generator | None,
        on_tokens: Callable[[int], None],
    ) -> DecodeOutput:
        """Decode one prompt.

        Args:
            prompt_ids: ``LongTensor`` of shape ``(1, prompt_len)`` on the pair's device.
            on_tokens: call with the number of tokens just committed, every time some are (the harness
                reads its clock on the first call: time to first token).
        """
        raise NotImplementedError

    def decode_batch(self, prompts: list[torch.Tensor], max_new_tokens: int, sampling: Sampling,
                     generators: list[torch.Generator | None], on_tokens: list[Callable[[int], None]]
                     ) -> list[DecodeOutput]:
        """Decode ``prompts`` together, one target forward per step for all (issue 41; :class:`DraftVerify`'s)."""
        raise BenchError(f"{self.name} cannot decode a batch yet: {self.batch_refusal}; decode its prompts one at a "
                         "time (batch_size=1).")

    @cached_property  # read at every decoding step: the tokenizer and generation config do not change
    def eos_ids(self) -> frozenset[int]:
        if self.pair.synthetic:  # random weights: every prompt decodes its full budget (vLLM's ignore_eos)
            return frozenset()
        tok = self.pair.tokenizer
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        gen = getattr(self.pair.target.module, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(extra, int):
            ids.add(extra)
        elif extra:
            ids.update(extra)
        return frozenset(ids)


@dataclass
class Proposal:
    """What a method proposes for one target forward: a token tree rooted at the pending token.

    ``q``: ``FloatTensor (len(tree), vocab)``: row v is the distribution node v's token was drawn from, when
    sampling from a draft model (row 0 unused); ``None`` for a deterministic drafter (n-gram lookups, the
    top-k of heads), whose q is one-hot. ``logit_rows``: how many rows of logits the target must return, the last
    ones (0: all). ``side``: rows the same forward reads that are no candidates (Lookahead's Jacobi window; their
    logits go to :meth:`DraftVerify.side_scored`, their KV entries are dropped), or None.
    """

    tree: Tree
    q: torch.Tensor | None = None
    logit_rows: int = 0
    side: SideRows | None = None

    @classmethod
    def chain(cls, pending: int, tokens, q: torch.Tensor | None = None) -> Proposal:
        """A single path; ``q``: ``(len(tokens), vocab)`` when the tokens were sampled (None: deterministic)."""
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if q is not None:
            q = torch.cat([q.new_zeros(1, q.shape[-1]), q])  # row 0 (the pending token) is never tested
        return cls(Tree.chain(pending, tokens), q)

    @property
    def depth(self) -> int:
        """Drafted tokens along the deepest path: what one call can gain at most, less the bonus token."""
        return self.tree.max_depth


class PromptState:
    """One prompt's decoding state; :class:`DraftVerify` owns it, methods read it.

    ``seq``: prompt + committed tokens (a list); ``cache``: the target's KV cache; ``draft_budget``: tokens a method
    may still draft this step (the target's own token fills the last slot of the budget).
    """

    def __init__(self, method: Method, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                 generator: torch.Generator | None, on_tokens: Callable[[int], None], row: int | None = None):
        self.method, self.pair = method, method.pair
        self.prompt_ids, self.device = prompt_ids, prompt_ids.device
        self.max_new_tokens, self.sampling, self.generator = max_new_tokens, sampling, generator
        self.on_tokens = on_tokens
        self.seq: list[int] = prompt_ids[0].tolist()
        self.prompt_len = len(self.seq)
        # Contexts the prompt opens (a hook on a model, a compiled model's cache) and the decode closes when it ends, by
        # an error too.
        self.closing = ExitStack()
        # Row b of a batch (DraftVerify.decode_batch), whose models' batch caches the batch holds; None: a decode alone.
        self.row = row
        self.batch_rows: set[str] = set()  # the roles whose batch cache's row this prompt holds
        self.cache = self.own_cache(self.pair.target)  # the target's
        self.caches: list = []
        self.accept_lengths: list[int] = []
        self.drafted: list[int] = []
        self.done = False
        self.prompt_hidden: torch.Tensor | None = None  # (prompt_len, hidden) for methods with hidden = True
        self.prompt_logits: torch.Tensor | None = None  # (prompt_len, vocab) for methods with prompt_logits = True

    @property
    def out(self) -> list[int]:
        return self.seq[self.prompt_len:]

    @property
    def draft_budget(self) -> int:
        return self.max_new_tokens - len(self.seq) + self.prompt_len - 1

    def track(self, cache) -> None:
        """Roll ``cache`` back with the target's after each commit (a draft's cache, say)."""
        self.caches.append(cache)

    def own_cache(self, lm):
        """An empty KV cache of ``lm`` (a ``CountedLM``) for this decode: in a batch, the prompt's row of ``lm``'s batch
        cache, for the target and, for a method that batches its drafting (:attr:`DraftVerify.batched_drafting`), its
        drafts (their forwards are then yielded, :meth:`DraftVerify.steps`); alone, its compiled forwards' static
        cache when compiled (given back when the decode ends; for a model of the method's own, :meth:`Method.batch_parts`,
        that cache's one row, whose forwards the method yields); else a new ``DynamicCache``."""
        batch = lm.compiled is not None and lm.compiled.cache.rows > 1
        if self.row is not None and (lm is self.pair.target or (batch and self.method.batched_drafting)):
            if lm.role in self.batch_rows:
                raise BenchError(f"{self.method.name} asked for a second cache of the {lm.role} in one row of a batch; "
                                 "a method that runs two decodes of one model at once cannot decode a batch yet.")
            self.batch_rows.add(lm.role)
            return lm.compiled.cache.row(self.row)
        if batch and lm is not self.pair.target:  # a method that does not batch its drafting: eager, a cache per row
            return DynamicCache()
        cache = lm.new_cache(self.method.name)
        self.closing.callback(lm.release_cache, cache)
        if lm.compiled is not None and any(lm is part for part in self.method.batch_parts()):
            # A method's own model compiled at one row (bench.runner.compile_parts): its row of that cache, so that the
            # method yields its forwards as in a batch, and they run as a batch of one (_call).
            return cache.row(0)
        return cache

    def draft_cache(self, draft) -> Generator[dict, object, object]:
        """A KV cache of ``draft`` (a ``CountedLM``) that has read the prompt (its cost, counted) and is tracked;
        afterwards a method feeds it only what it has not read (``seq[cache.get_seq_length():]``). A generator of the
        prompt's draft forward (``cache = yield from state.draft_cache(draft)`` in a method's :meth:`~DraftVerify.start`),
        which a batch runs with the other rows'."""
        cache = self.own_cache(draft)
        yield {"lm": draft, "cache": cache, "input_ids": self.prompt_ids, "logits_to_keep": 1}
        self.track(cache)
        return cache

    def commit(self, tokens: list[int], drafted: int | None) -> None:
        """Append committed ``tokens``, cut them at the first EOS (kept) and at the budget, roll every tracked
        cache back to the committed text minus the pending token, and tell the harness. ``drafted``: the
        tokens proposed for this target call (``None`` for the prefill's token, which is no call's gain)."""
        if drafted is not None:
            self.accept_lengths.append(len(tokens))
            self.drafted.append(drafted)
        keep = min(len(tokens), self.draft_budget + 1)
        eos = next((i for i, t in enumerate(tokens[:keep]) if t in self.method.eos_ids), None)
        if eos is not None:
            keep = eos + 1
        self.seq.extend(tokens[:keep])
        self.done = eos is not None or self.draft_budget < 0
        for cache in (self.cache, *self.caches):
            truncate_cache(cache, len(self.seq) - 1)
        self.on_tokens(keep)

    def output(self, extra: dict | None = None) -> DecodeOutput:
        return DecodeOutput(self.out, self.accept_lengths, self.drafted, extra or {})


class DraftVerify(Method):
    """Draft-and-verify decoding: per step, ``propose`` a token tree (a chain is a tree of one path), the
    target scores all of it in ONE forward, ``verify`` keeps a root path, and the base commits it.

    Per-prompt state lives on the state object, never on ``self`` (one method instance decodes every prompt):
    a method with state of its own declares it as ``class State(PromptState)`` with annotated fields, sets them in
    :meth:`start` and reads them in the other hooks.

    Set ``prompt_logits = True`` to get the prefill's logits at every prompt position
    (:attr:`PromptState.prompt_logits`; the output head then runs on all of them, and is counted so).
    Set ``hidden = True`` to get the target's last hidden states: at the prefill (:attr:`PromptState.prompt_hidden`)
    and for the accepted path (the ``hidden`` argument of :meth:`accepted`).
    """

    hidden: bool = False
    prompt_logits: bool = False
    batch_refusal: str | None = None
    # Whether the method's draft-model forwards are yielded (:meth:`steps`), so that a batch runs each drafting step of
    # every row as ONE forward on the draft's batch cache; False: a batch drafts row after row, eagerly.
    batched_drafting: bool = False
    State: type[PromptState] = PromptState  # one prompt's state; a method with its own subclasses it

    def __init_subclass__(cls, **kwargs):
        """A subclass with a decode loop of its own (it overrides :meth:`decode`) is refused at B > 1 unless it says
        otherwise: a batch runs :meth:`steps`, not its loop."""
        super().__init_subclass__(**kwargs)
        if "decode" in cls.__dict__ and "batch_refusal" not in cls.__dict__:
            cls.batch_refusal = Method.batch_refusal

    def start(self, state: PromptState) -> None:
        """Per-prompt set-up after the target's prefill, before its first token is committed (a draft's
        prefill, an index of the prompt); part of the timed decode. May be a generator of model forwards, as
        :meth:`propose`."""

    def propose(self, state: PromptState) -> Proposal:
        """The tokens to verify after ``state.seq``; at most ``state.draft_budget`` deep. An empty tree is a plain step.

        A method with :attr:`batched_drafting` writes it as a generator: it yields each draft-model forward as
        ``{"lm": the CountedLM, "cache": its cache, "input_ids": (1, n), ...}`` (what the model takes for one
        sequence, and optionally ``swap``: ``(rows (n,) bool, fill (n, hidden))``, token embeddings replaced at those
        rows), or a small module's call as ``{"lm": the CountedModule, "args": (inputs,)}`` (heads), is sent its
        output, and returns the proposal; a batch runs the rows' forwards of one model as one."""
        raise NotImplementedError

    def verify(self, state: PromptState, proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], int]:
        """``(path, next_token)``: accepted nodes from the root (0) and the target's token after them.
        ``logits``: ``(len(proposal.tree), vocab)``, row v scoring the token after node v. Default: the shared
        lossless verifiers (:func:`decoding.verify.verify_chain` for a chain, else :func:`verify_tree`)."""
        if proposal.tree.is_chain:
            tokens = torch.tensor(proposal.tree.tokens[1:], dtype=torch.long, device=logits.device)
            q = proposal.q[1:] if proposal.q is not None else None
            n, nxt = verify_chain(tokens, q, logits, state.sampling, state.generator)
            return list(range(n + 1)), nxt
        return verify_tree(proposal.tree, logits, state.sampling, state.generator, proposal.q)

    def side_scored(self, state: PromptState, proposal: Proposal, logits: torch.Tensor) -> None:
        """Called after the forward of a draft with ``side`` rows, before :meth:`verify`; ``logits``: ``(len(
        proposal.side.keep), vocab)``, the kept side rows' in order."""

    def accepted(self, state: PromptState, proposal: Proposal, path: list[int], hidden: torch.Tensor | None) -> None:
        """Called after each step's commit (``path`` includes the root; ``hidden``: ``(len(path), hidden)``
        of the path's nodes when ``self.hidden``): update indexes, tallies, the next step's inputs (no
        need for those once ``state.done``)."""

    def extra(self, state: PromptState) -> dict:
        """Per-prompt method-specific figures for ``DecodeOutput.extra`` (JSON-able)."""
        return {}

    def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens) -> DecodeOutput:
        state = self.State(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens)
        with state.closing:  # what the prompt holds (a hook on a model) is let go however the decode ends
            steps = self.steps(state)
            request = next(steps)
            while True:
                lm, cache = request.pop("lm", self.pair.target), request.pop("cache", state.cache)
                try:
                    request = steps.send(_call(lm, cache, request))
                except StopIteration as stop:
                    return stop.value

    def steps(self, state: PromptState) -> Generator[dict, object, DecodeOutput]:
        """One prompt's decode, as a generator of its forwards: it yields each forward's keywords (what a
        ``CountedLM`` takes for one sequence; the target's on the prompt's cache unless ``lm`` and ``cache`` say
        otherwise: a draft's, from :meth:`start` or :meth:`propose`), is sent that forward's output, and returns the
        prompt's output. :meth:`decode` runs it alone; :meth:`decode_batch` runs one per prompt and the rows' forwards of
        one model as one."""
        target = self.pair.target
        # The prefill: the whole prompt in one forward; only the last position needs logits (unless asked).
        out = yield {"input_ids": state.prompt_ids, "logits_to_keep": 0 if self.prompt_logits else 1,
                     "output_hidden_states": self.hidden}
        state.prompt_hidden = out.hidden_states[-1][0] if self.hidden else None
        state.prompt_logits = out.logits[0] if self.prompt_logits else None
        yield from forwards_of(self.start(state))
        state.commit([int(next_token(out.logits[0, -1], state.sampling, state.generator))], drafted=None)
        while not state.done:
            proposal = yield from forwards_of(self.propose(state))
            past = state.cache.get_seq_length()
            # ONE target forward scores the pending token and every proposed node (and any side rows).
            keep = {"logits_to_keep": proposal.logit_rows} if proposal.logit_rows else {}
            out = yield tree_request(target, past, proposal.tree, self.hidden, proposal.side, **keep)
            logits, hidden = tree_scores(target, proposal.tree, proposal.side, out, self.hidden)
            if proposal.side is not None:
                self.side_scored(state, proposal, logits[len(proposal.tree):])
                logits = logits[: len(proposal.tree)]
            path, nxt = self.verify(state, proposal, logits)
            keep_path(state.cache, past, path)  # the root and the accepted nodes; the new token is pending
            state.commit([proposal.tree.tokens[v] for v in path[1:]] + [nxt], drafted=proposal.depth)
            self.accepted(state, proposal, path, hidden[path] if hidden is not None else None)
        return state.output(self.extra(state))

    def decode_batch(self, prompts: list[torch.Tensor], max_new_tokens: int, sampling: Sampling,
                     generators: list[torch.Generator | None], on_tokens: list[Callable[[int], None]]
                     ) -> list[DecodeOutput]:
        """Decode ``prompts`` (``(1, n_b)`` each) together, as :meth:`decode` decodes each (issue 41). One generator of
        forwards per prompt (:meth:`steps`); each round, the rows' forwards of one model run as ONE forward, padded to
        the longest, on that model's batch cache of at least ``len(prompts)`` rows (``core.compiled.CompiledLM`` with
        ``rows``, compiled or eager): first a draft's, while any row drafts, then the target's, once every unfinished
        row waits for its verification. A finished row, or a row no prompt has, idles as padding. A draft without a
        batch cache (a method without :attr:`batched_drafting`) runs row after row. Each row keeps its own cache row,
        randomness (``generators[b]``) and callback, and its output its share of the counts (``DecodeOutput.counts``)."""
        target = self.pair.target
        if self.batch_refusal or type(self).decode is not DraftVerify.decode:
            return super().decode_batch(prompts, max_new_tokens, sampling, generators, on_tokens)
        rows = target.compiled.cache.rows if target.compiled is not None else 0
        if not 0 < len(prompts) <= rows:
            raise BenchError(f"a batch of {len(prompts)} prompts decodes on the target's static cache of at least as "
                             f"many rows (it has {rows})")
        with ExitStack() as stack:
            caches = []  # the batch caches this batch holds
            for lm in (target, *self.pair.drafts, *self.batch_parts()):
                if lm.compiled is not None and lm.compiled.cache.rows == rows:
                    caches.append(lm.new_cache(self.name))
                    stack.callback(lm.release_cache, caches[-1])
            states = [self.State(self, ids, max_new_tokens, sampling, gen, told, row=b)
                      for b, (ids, gen, told) in enumerate(zip(prompts, generators, on_tokens))]
            for state in states:
                stack.enter_context(state.closing)
            # Per cache row (a last, smaller group: the cache's other rows idle; the rows move, a finished row's place
            # going to a running one: _running_first): its prompt, decode, generator, counts, next forward.
            idle = [None] * (rows - len(prompts))
            rowed = _Rows(list(range(len(prompts))) + idle, states + idle, [self.steps(s) for s in states] + idle,
                          [{} for _ in prompts] + idle)
            requests: list[dict | None] = [self._counted(rowed.ledgers[b], next, row) for b, row in
                                           enumerate(rowed.steps[:len(prompts)])] + idle
            outputs: list[DecodeOutput | None] = [None] * len(prompts)
            while any(r is not None for r in requests):
                models = [r.get("lm", target) if r is not None else None for r in requests]  # what each row waits on
                lm = next((m for m in models if m is not None and m is not target), target)
                outs = self._forward_rows(lm, [r if m is lm else None for r, m in zip(requests, models)],
                                          rowed.ledgers)
                for b, out in enumerate(outs):
                    if out is None:
                        continue
                    if lm is target:
                        target.compiled.layer_inputs = target.compiled.layer_inputs_of[b]  # this row's, for its taps
                    try:  # the row goes on to its next forward (verifying, committing, drafting: counted to it)
                        requests[b] = self._counted(rowed.ledgers[b], rowed.steps[b].send, out)
                    except StopIteration as stop:
                        outputs[rowed.prompts[b]], requests[b] = stop.value, None
                        outputs[rowed.prompts[b]].counts = rowed.ledgers[b]
                _running_first(requests, rowed, caches)
            return outputs

    def _forward_rows(self, lm, requests: list[dict | None], ledgers: list[dict]) -> list:
        """The rows' forwards of ``lm`` (``requests[b]``: row b's, as :meth:`steps` yields it; None: the row does not
        run this one): ONE forward on ``lm``'s batch cache when the rows' caches are its rows (each row's share of the
        counts added to its ledger); a small module's calls (``args``: heads) stacked into one call per shape
        (``core.counting.CountedModule.forward_rows``); else one forward per row on its own cache. The outputs per
        row, None where none."""
        calls = [{k: v for k, v in r.items() if k not in ("lm", "cache")} if r is not None else None for r in requests]
        caches = [r.get("cache") if r is not None else None for r in requests]
        stacked = any(c is not None and "args" in c for c in calls)  # a small module's calls (heads): no cache
        if stacked or lm is self.pair.target or any(isinstance(c, RowView) for c in caches):
            if not stacked and any(c is not None and not (isinstance(c, RowView) and c.owner is lm.compiled.cache
                                                          and c.b == b) for b, c in enumerate(caches)):
                raise ValueError(f"a batch forward of the {lm.role} reads each row's own row of its batch cache")
            outs, shares = lm.forward_rows(calls)
            for b, share in enumerate(shares):
                if share is not None:
                    _add_counts(ledgers[b], {lm.role: share})
            return outs
        return [self._counted(ledgers[b], _call, lm, caches[b], call) if call is not None else None
                for b, call in enumerate(calls)]

    def _counted(self, ledger: dict, step, *args):
        """``step(*args)`` (a row's generator moving on), what it counts on the pair added to ``ledger``."""
        before = self.pair.counts()
        try:
            return step(*args)
        finally:
            after = self.pair.counts()
            _add_counts(ledger, {role: {k: v - before.get(role, {}).get(k, 0) for k, v in stats.items()}
                                 for role, stats in after.items()})


@dataclass
class _Rows:
    """Per row of a batch's caches (None where no prompt is): the prompt it holds (its index in the batch), its
    decode's state, its generator of forwards, its counts (role -> its share)."""

    prompts: list[int | None]
    states: list
    steps: list
    ledgers: list[dict | None]


def _running_first(requests: list[dict | None], rowed: _Rows, caches: list) -> None:
    """Move running rows into the places of finished ones before them, in every batch cache (``RowCache.move``) and
    in ``requests`` and ``rowed``, so that the running rows come first and the uncompiled forwards leave the finished
    ones out (``core.compiled.CompiledLM._run``): a finished row stops costing compute (issue 41)."""
    while True:
        free = next((b for b, r in enumerate(requests) if r is None), None)
        last = max((b for b, r in enumerate(requests) if r is not None), default=None)
        if free is None or last is None or last < free:
            return
        for cache in caches:
            cache.move(last, free)
        for column in (requests, rowed.prompts, rowed.states, rowed.steps, rowed.ledgers):
            column[free], column[last] = column[last], column[free]
        rowed.states[free].row = free
        if rowed.states[last] is not None:
            rowed.states[last].row = last


def _call(lm, cache, request: dict):
    """One forward of ``lm`` on ``cache`` as a request asks it (:meth:`DraftVerify.steps`: the model's keywords, and
    ``swap``, token embeddings replaced at some rows, :mod:`core.swapped_embeddings`)."""
    request = dict(request)
    if "args" in request:  # a small module's call (heads): its inputs, no cache
        return lm(*request["args"])
    if isinstance(cache, RowView):  # a method's own model compiled at one row (PromptState.own_cache): a batch of one
        return lm.forward_rows([request])[0][0]
    swap = request.pop("swap", None)
    with swapped_embeddings(lm, *swap) if swap is not None else nullcontext():
        return lm(cache=cache, **request)


def forwards_of(hook_result):
    """What a hook (:meth:`DraftVerify.start`, :meth:`~DraftVerify.propose`, a method's own step that may or may not
    run a batched forward) returns, through ``yield from``: a generator of forwards is run to its return value;
    anything else is that value."""
    if isinstance(hook_result, Generator):
        return (yield from hook_result)
    return hook_result


def _add_counts(ledger: dict, delta: dict) -> None:
    """Add ``delta`` (role -> counts) into ``ledger`` (the same), role by role and key by key."""
    for role, stats in delta.items():
        mine = ledger.setdefault(role, dict.fromkeys(stats, 0))
        for k, v in stats.items():
            mine[k] = mine.get(k, 0) + v
