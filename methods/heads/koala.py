"""KOALA (Zhang et al. 2024, "KOALA: Enhancing Speculative Decoding for LLM via Multi-Layer Draft Heads with
Adversarial Learning"): a draft head made K layers deep and trained with an adversarial term beside its
supervised loss, over a base head method that decodes exactly as before.

- ``method.base=medusa``: each Medusa head is ``K x ResBlock -> Linear`` (:class:`methods.heads._heads.Heads` with
  ``recipe.layers = K``), decoded through Medusa's candidate tree (``method.medusa.*``).
- ``method.base=eagle``: EAGLE's draft has K decoder layers instead of one (:class:`methods.eagle._draft.
  EagleDraft`), decoded by EAGLE-2's dynamic tree or a chain (``method.eagle.*``).

Both are trained from the teacher store with their base's supervised loss, for their base's epochs (so the
gain over the base is measured at the same training budget), plus ``recipe.adversarial`` (KOALA's
discriminator, :mod:`training.adversarial`); ``recipe.adversarial=null`` keeps the K layers and drops it. The
trained parts are cached beside the base's (their recipe differs), and verification is the base's: lossless.

``python -m bench run method=koala method.base=medusa baseline=medusa`` times KOALA against its base head,
prompt by prompt, in one run (the base with its own defaults: K = 1, no discriminator).
"""

from __future__ import annotations

from typing import Literal

from omegaconf import OmegaConf
from pydantic import Field, model_validator

from training.adversarial import AdversaryRecipe
from methods.eagle._draft import EagleRecipe
from methods.base import Method, MethodSettings
from methods.eagle.eagle import Eagle, EagleSettings
from methods.heads._heads import HeadsRecipe
from methods.heads._tree_heads import TreeHeadsSettings
from methods.heads.medusa import Medusa
from methods.registry import register
from training.kit import check_store_keeps_hidden

BASES = {"medusa": Medusa, "eagle": Eagle}


class KoalaSettings(MethodSettings):
    """KOALA's settings (``method.*``): the base, and the base's own settings with KOALA's recipe."""

    base: Literal["medusa", "eagle"] = Field("eagle", description="the head KOALA deepens and trains adversarially: "
                                             "medusa (non-autoregressive) or eagle (autoregressive)")
    medusa: TreeHeadsSettings = Field(
        default_factory=lambda: TreeHeadsSettings(name="medusa", recipe=HeadsRecipe(layers=2, adversarial=AdversaryRecipe())),
        description="base=medusa: Medusa's settings; recipe.layers is K (residual blocks per head)")
    eagle: EagleSettings = Field(
        default_factory=lambda: EagleSettings(name="eagle", recipe=EagleRecipe(layers=2, adversarial=AdversaryRecipe())),
        description="base=eagle: EAGLE-2's settings; recipe.layers is K (decoder layers of the draft)")

    @model_validator(mode="before")
    @classmethod
    def on_koalas_defaults(cls, data):
        """A partial ``medusa`` / ``eagle`` node is read over KOALA's defaults for it, not over the base method's
        (as the command line composes it), so ``eagle: {gamma: 2}`` keeps K layers and the discriminator."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for base in BASES:
            given = data.get(base)
            if isinstance(given, dict):
                default = cls.model_fields[base].default_factory().model_dump()
                data[base] = OmegaConf.to_container(OmegaConf.merge(default, given))
        return data

    @model_validator(mode="after")
    def trained_here(self):
        """KOALA's heads are trained here: its authors published none, and EAGLE's weights are not KOALA's."""
        if self.eagle.weights:
            raise ValueError("KOALA trains its own draft (its authors published no weights); eagle.weights is for "
                             "method=eagle.")
        return self


@register("koala")
class Koala(Method):
    """The base method, built from ``method.<base>`` and decoding unchanged; this class only chooses it."""

    lossless = True  # the base's verification; Medusa's typical acceptance says otherwise per instance
    Config = KoalaSettings
    label_settings = ("base",)  # "koala (base=medusa)": a koala row always says which head it deepened
    train_variants = ({"base": "medusa"}, {"base": "eagle"})  # train all: KOALA over each base
    batch_refusal = None  # a batch is its base's (decode_batch)

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.base = BASES[self.cfg.base](getattr(self.cfg, self.cfg.base), pair)
        # What the base's messages and hints name (e.g. "python -m bench train method method=koala method.base=medusa").
        self.base.name = f"koala method.base={self.cfg.base}"
        self.batched_drafting = self.base.batched_drafting  # EAGLE's draft forwards are yielded, Medusa's heads stacked

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        return True  # the K-layer head

    @classmethod
    def check_recipe(cls, settings: KoalaSettings, recipe) -> None:
        check_store_keeps_hidden("koala", recipe)  # before the base's, which would name the base
        BASES[settings.base].check_recipe(getattr(settings, settings.base), recipe)

    @property
    def report(self) -> dict:
        return self.base.report

    def setup(self, train_if_missing: bool = True) -> None:
        self.base.setup(train_if_missing)

    def batch_parts(self) -> list:
        return self.base.batch_parts()

    def row_parts(self, batch: int) -> list[tuple]:
        return self.base.row_parts(batch)

    def is_lossless(self, sampling) -> bool:
        return self.base.is_lossless(sampling)

    def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens):
        decoded = self.base.decode(prompt_ids, max_new_tokens, sampling, generator, on_tokens)
        decoded.extra["base"] = self.cfg.base
        return decoded

    def decode_batch(self, prompts, max_new_tokens, sampling, generators, on_tokens):
        """The base's batch decode (both bases run the shared loop), each row's extra naming the base."""
        decoded = self.base.decode_batch(prompts, max_new_tokens, sampling, generators, on_tokens)
        for out in decoded:
            out.extra["base"] = self.cfg.base
        return decoded
