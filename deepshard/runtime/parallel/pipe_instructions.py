"""DeepSpeed's pipeline schedules as instruction streams (``deepspeed.runtime.pipe.schedule``).

A schedule is built for one stage (``TrainSchedule(micro_batches, stages, stage_id)``) and
iterated: each item is one *step*, a list of :class:`PipeInstruction` that stage executes
before the next step (a barrier between steps cannot deadlock). Instructions on activations
and gradients name a *buffer* (``buffer_id``), the slot the engine keeps one micro-batch's
tensors in, reused cyclically. The classes and the streams they produce are DeepSpeed
0.19.8's, step for step, so code that subclasses ``PipeSchedule`` or inspects a schedule
ports unchanged.

deepshard's own pipeline engine runs the equivalent flat schedules of
:mod:`deepshard.runtime.parallel.schedule` (per micro-batch rather than per buffer, with a
deadlock simulator); nothing here touches torch.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any


class PipeInstruction:
    """One action of a step; its keyword arguments become attributes (``buffer_id``).

    Two instructions are equal when they are of the same class with the same arguments;
    ``repr`` is the call that builds one (``ForwardPass(buffer_id=0)``).
    """

    def __init__(self, **kwargs: Any):
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PipeInstruction) and type(other) is type(self) \
            and other.kwargs == self.kwargs

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after the reductions)."""


class ReduceGrads(PipeInstruction):
    """Reduce this stage's gradients over its data-parallel ranks."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied modules over the stages that share them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one pipeline buffer, ``buffer_id``."""

    def __init__(self, buffer_id: int, **kwargs: Any):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Take the next micro-batch from the data iterator into the buffer (first stage: its
    inputs; last stage: its labels)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the buffer's inputs."""


class BackwardPass(BufferOpInstruction):
    """Backpropagate the buffer's outputs with the received gradients."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (pairs with its RecvActivation)."""


class RecvActivation(BufferOpInstruction):
    """Receive the buffer's inputs from the previous stage (pairs with its SendActivation)."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's inputs to the previous stage (pairs with its
    RecvGrad)."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's outputs from the next stage (pairs with its
    SendGrad)."""


class PipeSchedule(abc.ABC):
    """The steps one stage executes for one batch of ``micro_batches`` over ``stages``
    stages; subclasses define :meth:`steps` (and may size :meth:`num_pipe_buffers`)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abc.abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield the instructions of each step, in order."""

    def num_pipe_buffers(self) -> int:
        """Buffers the engine allocates for this stage (default: one per micro-batch)."""
        return self.micro_batches

    @property
    def stage(self) -> int:
        """The stage this schedule is for."""
        return self.stage_id

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per batch."""
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        """Whether this is stage 0."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this is the last stage."""
        return self.stage_id == self.stages - 1

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """The buffer of a micro-batch: buffers are reused cyclically."""
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return iter(self.steps())


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B training: ``2 * (micro_batches + stages - 1)`` steps, forwards on
    the steps of the stage's parity and backwards on the others; the last step reduces the
    tied and data-parallel gradients and steps the optimizer."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield each step's instructions (see the class docstring)."""
        total = 2 * (self.micro_batches + self.stages - 1)
        prev = -1
        for step_id in range(total):
            forward = step_id % 2 == self.stage_id % 2
            if forward:
                mb = step_id // 2 - self.stage_id // 2
            else:
                mb = step_id // 2 + self.stage_id // 2 + 1 - self.stages
            cmds = self._exchange(forward, mb, prev)
            if forward and (self.is_first_stage or self.is_last_stage) \
                    and self._valid_micro_batch(mb):
                cmds.append(LoadMicroBatch(self._buffer_idx(mb)))
            if self._valid_micro_batch(mb):
                pass_ = ForwardPass if forward else BackwardPass
                cmds.append(pass_(self._buffer_idx(mb)))
            if step_id == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev = mb
            yield cmds

    def _exchange(self, forward: bool, mb: int, prev: int) -> list[PipeInstruction]:
        """A forward step sends the previous backward's input gradient back and receives
        its own input; a backward step receives its output gradient and sends the previous
        forward's output on."""
        cmds: list[PipeInstruction] = []
        neighbour = self.prev_stage if forward else self.next_stage
        if not self._valid_stage(neighbour):
            return cmds
        first, second = (SendGrad, RecvActivation) if forward else (RecvGrad, SendActivation)
        # the first instruction of the pair is about ``prev`` going forward, ``mb`` back
        first_mb, second_mb = (prev, mb) if forward else (mb, prev)
        if self._valid_micro_batch(first_mb):
            cmds.append(first(self._buffer_idx(first_mb)))
        if self._valid_micro_batch(second_mb):
            cmds.append(second(self._buffer_idx(second_mb)))
        return cmds

    def num_pipe_buffers(self) -> int:
        """The most forwards in flight: the stages after this one (at least 2, at most the
        micro-batches)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class InferenceSchedule(PipeSchedule):
    """Forward only: each micro-batch received, forwarded and sent on, with two buffers
    alternating (even stages send before they receive, odd ones after)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield each step's instructions (see the class docstring)."""
        for step_id in range(self.micro_batches + self.stages - 1):
            mb = step_id - self.stage_id
            even = self.stage_id % 2 == 0
            recv_buf = (step_id + (not even)) % 2
            send_buf = (step_id + even) % 2
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(mb):
                cmds.append(LoadMicroBatch(recv_buf))
            send: list[PipeInstruction] = [SendActivation(send_buf)] \
                if self._valid_stage(self.next_stage) and self._valid_micro_batch(mb - 1) else []
            recv: list[PipeInstruction] = [RecvActivation(recv_buf)] \
                if self._valid_stage(self.prev_stage) and self._valid_micro_batch(mb) else []
            cmds += send + recv if even else recv + send
            if self._valid_micro_batch(mb):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Two: one received into while the other is sent from."""
        return 2


class DataParallelSchedule(PipeSchedule):
    """Plain data parallelism with gradient accumulation: load, forward and backward each
    micro-batch in one buffer, then reduce and step."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield each step's instructions (see the class docstring)."""
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(buffer_id=0),
                                           ForwardPass(buffer_id=0), BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        """One buffer."""
        return 1
