"""Where the training data stands, saved in checkpoints and restored at any world size.

The loader ``initialize(training_data=...)`` builds samples through a
:class:`ResumableSampler`: a ``DistributedSampler`` (the same order: one permutation of the
dataset per epoch, seeded by ``seed + epoch``) that also knows how many samples of the
epoch the job has consumed (the engine's ``global_samples`` since the epoch's iteration
began). A checkpoint holds that position (epoch, samples consumed); after a load, the
next iteration starts right after them, split over the *current* ranks. An optimizer step
consumes the next ``train_batch_size`` samples of the permutation whatever the world
size, so a job relaunched on fewer or more ranks trains on the same global batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` with a position (see the module docstring); until a
    position is loaded it yields exactly what ``DistributedSampler`` yields."""

    def __init__(self, dataset, *, num_replicas: int, rank: int,
                 consumed: Callable[[], int], **kwargs):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, **kwargs)
        self._consumed = consumed
        self._skip = 0  # samples of this epoch consumed before the next iteration
        self._began_at: int | None = None  # global samples when this epoch began

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        self._began_at = self._consumed() - skip
        if not skip:
            return super().__iter__()
        order = self._order()[skip:]
        if self.drop_last:
            order = order[:len(order) - len(order) % self.num_replicas]
        elif order and len(order) % self.num_replicas:
            pad = self.num_replicas - len(order) % self.num_replicas
            order += (order * math.ceil(pad / len(order)))[:pad]
        return iter(order[self.rank::self.num_replicas])

    def __len__(self) -> int:
        if not self._skip:
            return super().__len__()
        left = max(0, len(self.dataset) - self._skip)
        rounding = math.floor if self.drop_last else math.ceil
        return rounding(left / self.num_replicas)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0  # another epoch starts at its beginning
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        consumed = self._skip if self._began_at is None else \
            self._consumed() - self._began_at
        return {"epoch": self.epoch, "consumed": consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._skip = int(state["consumed"])
        self._began_at = None


def resumable_loader(engine, dataset, collate_fn=None):
    """``engine.deepspeed_io(dataset)`` over a :class:`ResumableSampler` with the same
    replicas and rank as the sampler it would choose."""
    plain = engine.deepspeed_io(dataset, collate_fn=collate_fn).sampler
    sampler = ResumableSampler(dataset, num_replicas=plain.num_replicas, rank=plain.rank,
                               consumed=lambda: engine.global_samples)
    return engine.deepspeed_io(dataset, collate_fn=collate_fn, data_sampler=sampler)


def position(engine) -> dict[str, int] | None:
    """The position of the engine's training loader, for a checkpoint."""
    sampler = getattr(engine.training_dataloader, "sampler", None)
    return sampler.state_dict() if isinstance(sampler, ResumableSampler) else None


def restore(engine, state: dict[str, int] | None) -> None:
    """Put the engine's training loader at a checkpoint's position."""
    sampler = getattr(engine.training_dataloader, "sampler", None)
    if state is not None and isinstance(sampler, ResumableSampler):
        sampler.load_state_dict(state)
