"""The training loader of a curriculum: DeepSpeed's ``DeepSpeedDataLoader`` with
``curriculum_learning`` on.

Its batches come from a :class:`~deepshard.data_efficiency.sampler.CurriculumSampler` (the
sampler *is* the loader's batch sampler), each passed through the post-process function
with the sampler's state *as of that batch*: the user's (``engine.set_data_post_process_func``,
DeepSpeed's ``post_process_func(batch, sampler_state)``) or, without one,
:func:`deepshard.data_efficiency.seqlen.post_process`, which applies the ``seqlen_truncate``
and ``seqlen_reshape`` metrics. With loader workers the sampler runs ahead of the batch the
model sees; the state of each batch is recorded when it is drawn, so the difficulty a batch
is cut to and the position a checkpoint saves are that batch's (DeepSpeed hands the
sampler's latest state instead).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from deepshard.data_efficiency.sampler import CurriculumSampler
from deepshard.data_efficiency.seqlen import post_process

PostProcess = Callable[[Any, dict[str, Any]], Any]


class _Recorded:
    """The sampler as a batch sampler that notes its state after each batch it draws."""

    def __init__(self, sampler: CurriculumSampler, states: deque[dict[str, Any]]):
        self.sampler, self.states = sampler, states

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        for ids in self.sampler:
            self.states.append(self.sampler.state_dict())
            yield ids


class CurriculumLoader:
    """This rank's micro-batches of a curriculum (see the module docstring); DeepSpeed's
    attribute names: ``data_sampler``, ``post_process_func``."""

    def __init__(self, dataset: Any, sampler: CurriculumSampler, collate_fn: Any = None,
                 num_workers: int = 0, pin_memory: bool = False):
        self.dataset, self.data_sampler = dataset, sampler
        self.post_process_func: PostProcess | None = None
        self._drawn: deque[dict[str, Any]] = deque()
        self._current = sampler.state_dict()
        self._loader = DataLoader(dataset, batch_sampler=_Recorded(sampler, self._drawn),
                                  collate_fn=collate_fn, num_workers=num_workers,
                                  pin_memory=pin_memory and torch.cuda.is_available())

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        self._drawn.clear()
        for batch in self._loader:
            self._current = self._drawn.popleft()
            yield (self.post_process_func or post_process)(batch, self._current)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the last batch this loader handed out."""
        return self._current

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the batch ``state`` was saved at (the next iteration starts
        there)."""
        self.data_sampler.load_state_dict(state)
        self._current = self.data_sampler.state_dict()
        self._drawn.clear()
