"""training/kit.py's shared trainer scaffold: ``training_start``, ``answer_rows``, ``vocab_coverage`` and
``load_or_train`` (what the six trainers and the methods that read their parts share)."""

import math

import pytest
import torch

from core.errors import BenchError
from training.kit import answer_rows, load_or_train, part_artifact, training_start, vocab_coverage


def test_training_start_seeds_first_and_copies_only_a_target_not_in_fp32():
    fp32 = torch.nn.Linear(4, 4).eval()
    target, device = training_start(fp32, seed=7)
    drawn = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(3))  # nothing drew between the seed and the trainer's first draw
    assert target is fp32 and device == torch.device("cpu")  # fp32 already: the target itself, no copy

    half = torch.nn.Linear(4, 4).to(torch.bfloat16).train()
    target, _ = training_start(half, seed=7)
    assert target is not half and next(target.parameters()).dtype == torch.float32 and not target.training
    assert next(half.parameters()).dtype == torch.bfloat16  # the pair's target is left as it was


class _Store:
    """A held-out store of five rows: ``kind(i)`` says what row i holds, as a teacher store's does."""

    kinds = ["text", "answers", "text", "answers", "answers"]

    def __len__(self):
        return len(self.kinds)

    def kind(self, i):
        return self.kinds[i]


def test_answer_rows_are_exactly_the_stores_answer_rows_in_order():
    assert answer_rows(_Store()) == [1, 3, 4]


def test_vocab_coverage_counts_labelled_positions_only_and_rounds_to_four_places():
    to_sub = torch.tensor([0, -1, 1, -1, 2])  # tokens 0, 2, 4 are in the reduced vocabulary
    idx = torch.tensor([[[0, 1], [1, 0], [2, 3]], [[3, 0], [4, 4], [1, 1]]])  # (N=2, T=3, k=2); top-1 first
    mask = torch.tensor([[True, True, True], [False, True, False]])
    # Labelled top-1 tokens: 0, 1, 2 and 4: three of four are in the vocabulary (the unlabelled 3 and 1 do not count).
    assert vocab_coverage(to_sub, {"idx": idx, "mask": mask}) == 0.75
    assert vocab_coverage(to_sub, {"idx": idx, "mask": mask & torch.tensor([True, True, False])}) == 0.6667
    assert math.isnan(vocab_coverage(to_sub, {"idx": idx, "mask": torch.zeros_like(mask)}))


def test_load_or_train_trains_once_then_returns_the_cached_part_and_its_report(tmp_path):
    trained = []

    def train():
        trained.append(1)
        part = torch.nn.Linear(2, 1)
        torch.nn.init.constant_(part.weight, 0.5)
        return part, {"agreement_after": 0.25, "epochs": 1}

    def load(blob):
        part = torch.nn.Linear(2, 1)
        part.load_state_dict(blob)
        return part.eval()

    art = part_artifact("demo", "part", {"n": 1}, train, lambda part: part.state_dict(), load, "part.pt",
                        trained_by="demo", description="demo part")
    with pytest.raises(BenchError, match=r"no cached demo part at .*python -m bench train method method=demo"):
        load_or_train(art, tmp_path, train_if_missing=False)
    assert not trained
    part, report = load_or_train(art, tmp_path)
    assert trained == [1] and report == {"agreement_after": 0.25, "epochs": 1}
    again, same = load_or_train(art, tmp_path, train_if_missing=False)  # from the cache, not trained again
    assert trained == [1] and same == report
    assert again is not part and torch.equal(again.weight, torch.full((1, 2), 0.5))
