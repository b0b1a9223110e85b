"""The curriculum loader: each batch cut to the difficulty it was drawn at, also when loader
workers run ahead of the model, and its position carried across a resume."""

from __future__ import annotations

import pytest
import torch

from deepshard.data_efficiency.loader import CurriculumLoader
from deepshard.data_efficiency.sampler import CurriculumSampler

SEQ = 64
SECTION = {"seed": 5, "data_sampling": {"curriculum_learning": {
    "enabled": True, "curriculum_metrics": {"seqlen_truncate": {
        "min_difficulty": 8, "max_difficulty": SEQ, "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 7, "difficulty_step": 8}}}}}}


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int):
        return torch.full((SEQ,), i), torch.full((SEQ,), i)


def loader(workers: int = 0) -> CurriculumLoader:
    sampler = CurriculumSampler.from_config(SECTION, dataset_len=200, micro_batch_size=4)
    return CurriculumLoader(Tokens(), sampler, num_workers=workers)


def expected_length(step: int) -> int:
    """fixed_linear from 8 to 64 over 7 steps, multiples of 8 (step counted from 1)."""
    return min(SEQ, max(8, int((step / 7) * (SEQ - 8) + 8) // 8 * 8))


@pytest.mark.parametrize("workers", [0, 1])
def test_each_batch_is_cut_to_its_own_difficulty(workers):
    lengths = []
    for n, (x, y) in enumerate(loader(workers)):
        assert x.shape == y.shape == (4, x.shape[1])
        lengths.append(x.shape[1])
        if n == 9:
            break
    assert lengths == [expected_length(step) for step in range(1, 11)]


def test_a_custom_post_process_gets_the_batchs_state():
    seen = []
    made = loader()
    made.post_process_func = lambda batch, state: seen.append(
        (state["curriculum_step"], state["current_difficulties"]["seqlen_truncate"])) or batch
    batches = iter(made)
    for _ in range(3):
        next(batches)
    assert seen == [(s, expected_length(s)) for s in (1, 2, 3)]


def test_resume_continues_with_the_next_batch():
    whole = loader()
    batches = iter(whole)
    for _ in range(4):
        next(batches)
    state = whole.state_dict()
    want = [next(batches)[0][:, 0].tolist() for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(state)
    again = iter(resumed)
    assert [next(again)[0][:, 0].tolist() for _ in range(3)] == want
