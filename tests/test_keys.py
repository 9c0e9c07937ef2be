"""Keys pinned from before the layout change of issue 29: moving code between packages must not change where a
run's records or a trained part are found, or every user's cache and resumable run would be lost.

Each value was computed on the tiny pair with the code as it stood before the move (commit eccc818). A change
that alters one on purpose (a new key field, a new file format) updates the value here and says so."""

from omegaconf import OmegaConf

from tests.helpers import get_method, method_cfg

PINNED_FOLDERS = {
    "draft": "llama-aa039b121106", "medusa": "medusa-llama-6470e774f6bd", "hydra": "hydra-llama-b32b56f61f56",
    "hydra_pp": "hydra-llama-83e4762eef69", "amphista": "amphista-llama-6d822afb637b",
    "eagle": "eagle-llama-f355aeea64db", "glide": "glide-llama-f5cde0d23171", "space": "space-llama-fc1b7f25031e",
}
PINNED_RUN_KEYS = {"ar": "20ead56bd42ab299e178", "sd": "830a802079998231b33a", "medusa": "0a6f059a686aed564cac",
                   "eagle": "a35750f9addd374eba16"}


def _folders(pair):
    """Folder names of every trained part a method of the tiny pair reads under the quick recipe (nothing is
    trained: only keys are computed)."""
    from methods.eagle._draft import eagle_artifact
    from methods.glide._draft import glide_artifact
    from methods._space import space_artifact
    from methods.heads._train import heads_artifact
    from training.distill import DistillRecipe, draft_artifact

    t, tok, teacher = pair.target.module, pair.tokenizer, pair.teacher
    draft = OmegaConf.create(DistillRecipe().model_dump(mode="json"))
    out = {"draft": draft_artifact(t, tok, draft, teacher)}
    for name in ("medusa", "hydra", "hydra_pp", "amphista"):
        out[name] = heads_artifact(t, tok, get_method(name).kind, method_cfg(name).recipe, teacher)
    out["eagle"] = eagle_artifact(t, tok, method_cfg("eagle").recipe, teacher)
    out["glide"] = glide_artifact(t, tok, method_cfg("glide").recipe, teacher)
    out["space"] = space_artifact(t, tok, 5, method_cfg("space").recipe, teacher)
    return {name: art.folder("").name for name, art in out.items()}


def _run_keys(compose_cfg):
    from bench.results import run_key

    cfg = compose_cfg("pair=tiny", "recipe=quick", "max_new_tokens=64")
    return {name: run_key(OmegaConf.to_container(method_cfg(name)), cfg, "p0", trained=trained)
            for name, trained in (("ar", False), ("sd", False), ("medusa", True), ("eagle", True))}


def test_trained_parts_keep_their_folders(compose_cfg):
    from bench.models import load_pair

    pair = load_pair(compose_cfg("pair=tiny", "recipe=quick"))
    assert _folders(pair) == PINNED_FOLDERS


def test_run_keys_are_unchanged(compose_cfg):
    assert _run_keys(compose_cfg) == PINNED_RUN_KEYS
