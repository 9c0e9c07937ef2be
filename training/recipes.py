"""The run's training recipes (``recipe=smoke|quick|full``): how much of the target's labels the trainers read, and
what the teacher store holds (``recipe.store``). A recipe names no method: each trained part declares its own
passes per recipe (``training.loop.TrainRecipe.EPOCHS``)."""

from __future__ import annotations

from pydantic import Field

from core.artifacts import content_key
from core.corpus import Corpus, Instructions
from core.schema import Settings


class StoreSettings(Settings):
    """``recipe.store.*``: what the teacher store holds and how it is built (its size is ``recipe.tokens``)."""

    corpus: Corpus = Field("lee+wiki", description="packaged text that is teacher-forced")
    answers: float = Field(0.25, ge=0, le=1, description="share of shards made of the target's own greedy "
                           "answers to packaged instructions (on-policy text)")
    answer_tokens: int = Field(128, ge=1, description="tokens per answer at most")
    answer_batch: int = Field(16, ge=1, description="answers generated per batch")
    seq_len: int = Field(256, ge=2, description="tokens per stored sequence")
    shard_sequences: int = Field(64, ge=1, description="sequences per shard: the unit that is built, kept after "
                                 "a kill and appended (held-out shards hold a quarter as many)")
    topk: int = Field(32, ge=1, description="the target's top-k next-token probabilities kept per position")
    hidden: bool = Field(True, description="keep the target's last hidden states (float16): heads, the SPRINTER "
                         "verifier's sampling labels and the teacher loss need them")
    batch_size: int = Field(8, ge=1, description="sequences per teacher-forced forward")
    seed: int = Field(0, ge=0, description="which instructions are answered, in which order")
    instructions: Instructions = Field("news+wiki", description="what the answered instructions are: news+wiki = "
                                       "tasks on packaged articles; mixed = those in two of five, with advice, "
                                       "explanations of topics and arithmetic word problems (core/corpus.py)")

    def key(self, kind: str = "answers") -> dict:
        """The settings as store shards (of ``kind``) and trained parts are keyed by (:func:`store_key`)."""
        return store_key(self.model_dump(mode="json"), kind)


def store_key(store: dict, kind: str = "answers") -> dict:
    """``store`` (``recipe.store`` as a dict) as keys see it. ``instructions`` enters only for answers, and only when
    it is not ``news+wiki``, the one kind there was before it was a setting: what was built (and run) then keeps its
    key, and the teacher-forced text shards are shared by both."""
    data = dict(store)
    if data.get("instructions") == "news+wiki" or kind == "text":
        data.pop("instructions", None)
    return data


class RecipeSettings(Settings):
    """How much the target labels for the trainers (``recipe=smoke|quick|full``). Every trained part of a run reads
    the same teacher store under the same recipe, for as many passes as the part itself declares for the recipe
    (``training.loop.TrainRecipe.EPOCHS``: the recipe names no method); records name the recipe behind each
    trained method."""

    name: str = Field("quick", pattern=r"^[A-Za-z0-9_.-]+$", description="the recipe's name, as records and "
                      "tables show it")
    tokens: int = Field(65536, ge=1, description="teacher tokens each trainer reads (train split: the first "
                        "ceil(tokens / seq_len) stored sequences); the store grows to hold them")
    eval_tokens: int = Field(16384, ge=1, description="held-out teacher tokens (test split) for the trainers' "
                             "reports")
    store: StoreSettings = Field(default_factory=StoreSettings, description="what the teacher store holds")

    @property
    def label(self) -> str:
        """The recipe as records and tables name it: its name, or ``name~<hash>`` when settings were overridden."""
        preset = RECIPES.get(self.name)
        if preset is not None and preset == self:
            return self.name
        return f"{self.name}~{content_key({**self.model_dump(mode='json'), 'store': self.store.key()})[:6]}"


# The presets of ``recipe=NAME``. quick and full share one store (full appends to quick's shards); full is
# sized for ``python -m bench train all recipe=full`` in about an hour on 2 CPU cores for the methods of issue 12;
# with every trained method since, about 3 h (README: measured).
RECIPES = {
    "smoke": RecipeSettings(name="smoke", tokens=4096, eval_tokens=1024,
                            store=StoreSettings(corpus="lee", seq_len=64, shard_sequences=16, answer_tokens=32, topk=8)),
    "quick": RecipeSettings(),
    "full": RecipeSettings(name="full", tokens=163840, eval_tokens=32768),
}
