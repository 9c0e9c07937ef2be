"""The trained-method contract (docs/adding-a-method.md): a method whose ``setup()`` reads an artifact keyed by
the run's training recipe (a part trained from the target, or the teacher store itself) says so through
``has_trained_parts``, and one that says so reads one. Otherwise its records would name no recipe (or a recipe
they do not depend on) and its run keys would ignore it: a resumed run would silently keep the records of another
recipe."""

import dataclasses

import pytest

from core import artifacts
from core.errors import BenchError
from methods.registry import get_method, known_methods
from training.teacher import Teacher


def recipe_keyed(art: artifacts.Artifact) -> bool:
    """Whether an artifact's content depends on the run's recipe: a teacher store's shard, or anything keyed with
    the teacher's budget (``training.kit.budget``) or the store's settings."""
    return art.kind == "teacher" or "teacher" in art.key or "store" in art.key


def read_by_setup(method) -> list[artifacts.Artifact]:
    """Every artifact ``method.setup()`` asks for, in an empty cache where nothing may be built: it stops at the
    first one missing, which is enough to know whether it reads one keyed by the recipe."""
    seen = []
    folder = artifacts.Artifact.folder

    def recording(art, cache):
        seen.append(art)
        return folder(art, cache)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(artifacts.Artifact, "folder", recording)
        try:
            method.setup(train_if_missing=False)
        except BenchError:
            pass
    return seen


@pytest.fixture(scope="module")
def empty_pair(tiny_pair, tmp_path_factory):
    """The tiny pair with an empty cache and a teacher that may build nothing."""
    cache = tmp_path_factory.mktemp("empty-cache")
    teacher = Teacher(tiny_pair.teacher.recipe, cache, False)
    return dataclasses.replace(tiny_pair, cache=cache, teacher=teacher, roles=dict(tiny_pair.roles))


# Every method as ``train all`` trains it, and the settings that change whether it trains.
CASES = [(label, name, s) for name in known_methods() for label, s in get_method(name).variants()] + [
    ("rest (datastore=answers)", "rest", get_method("rest").check_settings({"datastore": "answers"})),
    ("samd (aux=eagle)", "samd", get_method("samd").check_settings({"aux": "eagle"})),
]


@pytest.mark.parametrize("label,name,settings", CASES)
def test_a_method_trains_exactly_when_its_setup_reads_a_recipe_keyed_artifact(label, name, settings, empty_pair):
    cls = get_method(name)
    reads = [a.what for a in read_by_setup(cls(settings, empty_pair)) if recipe_keyed(a)]
    says = cls.trains(empty_pair.spec, settings)
    assert says == bool(reads), (f"{label}: trains() says {says}, but its setup reads "
                                 f"{reads or 'nothing keyed by the recipe'}")
