"""DeepSpeed's pipeline engine: ``engine.train_batch(data_iter)`` over a ``PipelineModule``.

Each stage executes its 1F1B action list (:func:`.schedule.one_f_one_b`) in order with
blocking point-to-point sends and receives to its neighbours (the order itself rules out
deadlock: on every link an activation goes before the gradient). A micro-batch's
activation crosses a link as a small shape header, then the tensor. After the last
backward: tied weights' gradients are summed over the stages sharing them, gradients are
reduced over the data-parallel group (ZeRO 0 or 1), and the optimizer steps.

The loss is computed on the last stage (``loss_fn(outputs, labels)``), scaled by
``1 / (micro-batches × data-parallel size)`` like any accumulated loss, and the batch's
mean loss is broadcast to every stage, as DeepSpeed returns it.

``engine.eval_batch(data_iter)`` runs the forward-only schedule
(:func:`.schedule.forward_only`) under ``torch.no_grad()`` with the module in eval mode:
no gradient, no step, no counter moves, so training continues exactly as without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from deepshard.errors import UsageError
from deepshard.liveness import heartbeat
from deepshard.runtime.engine import DeepShardEngine, EngineParts
from deepshard.runtime.loss_scaler import backward_factor
from deepshard.runtime.parallel import schedule as S
from deepshard.runtime.parallel.pipe_module import PipelineModule
from deepshard.runtime.parallel.tied import TiedWeightGroups
from deepshard.runtime.parallel.topology import ProcessGroups

HEADER = 8  # ndim, dtype code, up to six dims
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32)


@dataclass
class _Batch:
    """One ``train_batch``'s micro-batches in flight and its timings."""

    started: float
    factor: float  # the loss multiplier before backward
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    labels: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_in: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_out: dict[int, torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    forward_s: float = 0.0
    backward_s: float = 0.0
    pipe_s: float = 0.0


class PipelineEngine(DeepShardEngine):
    """A :class:`DeepShardEngine` whose module is one stage of a ``PipelineModule``."""

    last_batch_timing: dict[str, float]
    """Seconds of the last ``train_batch``: ``total_s`` (all of it), ``pipe_s`` (the 1F1B
    schedule, before gradient reduction and the step), ``forward_s``/``backward_s`` (this
    stage's compute) and ``busy_s`` (their sum); ``1 - busy_s / pipe_s`` is the stage's
    bubble."""

    def __init__(self, parts: EngineParts, groups: ProcessGroups, tied: TiedWeightGroups):
        super().__init__(parts)
        if not isinstance(parts.module, PipelineModule):
            raise TypeError("PipelineEngine needs a PipelineModule")
        self.grid = self.mpu = groups
        self._tied = tied
        self.stage_id = parts.module.stage_id
        self.num_stages = parts.module.num_stages
        self.last_batch_timing: dict[str, float] = {}
        self.data_iterator = None
        self.batch_fn = None
        self._batch_seconds = 0.0
        self._monitor.loss_by_caller = True  # train_batch writes the all-stage mean

    # -- DeepSpeed's data plumbing -------------------------------------------------------
    def training_loader(self, dataset, collate_fn=None):
        """``initialize(training_data=...)``: as DeepSpeed's pipeline engine, this rank's
        share in order (no shuffle), repeating, and what ``train_batch()`` draws from when
        it is given no iterator."""
        from torch.utils.data import DistributedSampler

        from deepshard.runtime.utils import RepeatingLoader

        sampler = DistributedSampler(dataset, num_replicas=self.dp_world_size,
                                     rank=self.dp_rank, shuffle=False)
        loader = RepeatingLoader(self.deepspeed_io(dataset, data_sampler=sampler,
                                                   collate_fn=collate_fn))
        self.set_dataloader(loader)
        return loader

    def set_dataloader(self, loader) -> None:
        """Draw ``train_batch()``'s micro-batches from ``loader`` (first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator) -> None:
        """Draw ``train_batch()``'s micro-batches from ``iterator`` (first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn) -> None:
        """Apply ``fn`` to every micro-batch read, before it is split into inputs and
        labels (DeepSpeed's)."""
        self.batch_fn = fn

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def forward(self, *inputs, **kwargs):
        raise UsageError("a pipeline engine is driven by engine.train_batch(data_iter)",
                         where="engine(...)", hint="call engine.train_batch(iter(loader)), "
                                                   "or engine.eval_batch(iter(loader))")

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one optimizer step over ``gradient_accumulation_steps`` micro-batches drawn
        from ``data_iter`` (``(inputs, labels)`` each; the first stage reads inputs, the
        last labels). Returns the mean loss over the whole batch (every data-parallel
        replica), on every stage."""
        module: PipelineModule = self.module
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        data_iter = self.data_iterator
        if (self.is_first_stage() or self.is_last_stage()) and data_iter is None:
            raise UsageError("train_batch() needs data_iter on the first and last stages",
                             where="engine.train_batch",
                             hint="pass iter(your_loader), or training_data= to initialize")
        if self.is_last_stage() and module.loss_fn is None:
            raise UsageError("the PipelineModule has no loss_fn", where="PipelineModule",
                             hint="build it with loss_fn=<function(outputs, labels)>")
        m = self._config.gradient_accumulation_steps
        b = _Batch(time.perf_counter(), backward_factor(m, self._averaged_over,
                                                        self.loss_scaler))
        # None only on the first (last) stage, whose schedule never receives (sends) there
        prev = cast(int, self.grid.prev_stage_rank)
        nxt = cast(int, self.grid.next_stage_rank)
        for action in S.one_f_one_b(self.num_stages, self.stage_id, m):
            mb = cast(int, getattr(action, "mb", None))  # None: an action without one
            if isinstance(action, S.LoadMicroBatch):
                self._load(data_iter, mb, b.inputs, b.labels)
            elif isinstance(action, S.RecvActivation):
                b.inputs[mb] = _recv(prev, self.device).requires_grad_()
            elif isinstance(action, S.Forward):
                self._train_forward(b, mb)
            elif isinstance(action, S.SendActivation):
                self._send_activation(b.outputs[mb], nxt)
            elif isinstance(action, S.RecvGrad):
                b.grad_out[mb] = _recv(nxt, self.device)
            elif isinstance(action, S.Backward):
                self._train_backward(b, mb)
            elif isinstance(action, S.SendGrad):
                _send(b.grad_in.pop(mb), prev)
            elif isinstance(action, S.ReduceTiedGrads):
                b.pipe_s = time.perf_counter() - b.started
                self._tied.all_reduce_grads(module)
            elif isinstance(action, S.ReduceGrads):
                self.strategy.reduce_now()
            elif isinstance(action, S.OptimizerStep):
                self.counters.micro_steps += m - 1
                self.step()
        mean = self._batch_mean(b.losses)
        self.last_batch_timing = {
            "total_s": time.perf_counter() - b.started, "pipe_s": b.pipe_s,
            "busy_s": b.forward_s + b.backward_s, "forward_s": b.forward_s,
            "backward_s": b.backward_s}
        heartbeat(self.counters.global_steps)
        self._monitor.write_train_loss(mean, self.global_samples)
        self._print_progress(mean)
        return mean

    def _print_progress(self, mean: torch.Tensor) -> None:
        """DeepSpeed's pipeline progress line on rank 0 every ``steps_per_print`` steps,
        timed over the ``train_batch`` calls since the last one."""
        self._batch_seconds += self.last_batch_timing["total_s"]
        every = self._config.steps_per_print
        if not every or self.global_steps % every:
            return
        iter_time, self._batch_seconds = self._batch_seconds / every, 0.0
        if self.global_rank == 0:
            print(f"steps: {self.global_steps} loss: {float(mean):0.4f} iter time (s): "
                  f"{iter_time:0.3f} samples/sec: {self.train_batch_size() / iter_time:0.3f}",
                  flush=True)

    def _train_forward(self, b: _Batch, mb: int) -> None:
        t0 = time.perf_counter()
        module: PipelineModule = self.module
        x = b.inputs[mb]
        # a received activation is a leaf that requires grad: the stage gets a copy, which
        # its first layer may change in place (an nn.ReLU(inplace=True), as DeepSpeed's)
        out = module(x.clone() if x.is_leaf and x.requires_grad else x)
        if self.is_last_stage():
            assert module.loss_fn is not None  # train_batch() checked it
            loss = module.loss_fn(out, b.labels.pop(mb))
            b.losses.append(loss.detach().float())
            self._monitor.record_loss(loss)  # the heartbeat's loss, on the last stage
            out = loss.float() * b.factor
        b.outputs[mb] = out
        b.forward_s += time.perf_counter() - t0

    def _train_backward(self, b: _Batch, mb: int) -> None:
        t0 = time.perf_counter()
        out = b.outputs.pop(mb)
        grad = None if self.is_last_stage() else b.grad_out.pop(mb)
        self.run_backward(lambda: torch.autograd.backward(out, grad), boundary=False)
        x = b.inputs.pop(mb)
        if x.requires_grad and not self.is_first_stage():
            b.grad_in[mb] = x.grad
        b.backward_s += time.perf_counter() - t0

    def _batch_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean loss over the whole batch (all replicas), on every stage, as DeepSpeed
        returns it."""
        mean = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        if self.is_last_stage() and self.dp_world_size > 1:
            dist.all_reduce(mean, group=self.strategy.group)
            mean /= self.dp_world_size
        if self.num_stages > 1:
            src = self.grid.topology.stage_rank(dist.get_rank(), self.num_stages - 1)
            dist.broadcast(mean, src=src, group=self.grid.pipe_group)
        return mean

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None):
        """Evaluate one batch, DeepSpeed's ``PipelineEngine.eval_batch``: forward only.

        Draws ``num_micro_batches`` (default ``gradient_accumulation_steps``) micro-batches
        ``(inputs, labels)`` from ``data_iter`` on the first and last stages and runs them
        through the pipeline under ``torch.no_grad()``, with the module in eval mode; every
        submodule's train/eval mode is restored afterwards, also on an error. Nothing
        else changes: no gradient, no optimizer step, no step counter, so a following
        ``train_batch`` behaves exactly as without this call.

        Args:
            data_iter: the micro-batches (needed on the first and last stages).
            return_logits: also return the last stage's module outputs.
            compute_loss: apply the module's ``loss_fn(outputs, labels)`` on the last
                stage (without one, or when False, the outputs themselves are reduced).
            reduce_output: ``"avg"``: the mean over the micro-batches and over the
                data-parallel replicas, like ``train_batch``'s loss; ``None``: the list of
                this replica's per-micro-batch values.
            bcast_loss: with ``compute_loss``, every stage of the pipeline returns the last
                stage's result; otherwise only the last stage has it (others get None).
            num_micro_batches: how many micro-batches to evaluate.

        Returns:
            The result above; with ``return_logits``, the pair ``(result, logits)`` where
            ``logits`` are the last micro-batch's outputs on the last stage (None on other
            stages), as DeepSpeed returns them.
        """
        m = self._check_eval_args(data_iter, reduce_output, num_micro_batches)
        module = self.module
        modes = [(sub, sub.training) for sub in module.modules()]
        module.eval()
        try:
            with torch.no_grad():
                values, logits = self._forward_only(data_iter, m, compute_loss)
                result = None
                if self.is_last_stage():
                    result = values if reduce_output is None else self._replica_mean(values)
                if compute_loss and bcast_loss:
                    result = self._from_last_stage(result, listed=reduce_output is None)
        finally:
            for sub, mode in modes:
                sub.training = mode
        heartbeat(self.counters.global_steps)
        return (result, logits) if return_logits else result

    def _check_eval_args(self, data_iter, reduce_output, num_micro_batches) -> int:
        where = "engine.eval_batch"
        if not (reduce_output is None or (isinstance(reduce_output, str)
                and reduce_output.lower() == "avg")):
            raise UsageError(f"reduce_output={reduce_output!r} is not a reduction",
                             where=where, hint='pass reduce_output="avg" for the mean, or '
                                               "None for the per-micro-batch list")
        if num_micro_batches is not None and (
                isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int)
                or num_micro_batches < 1):
            raise UsageError(f"num_micro_batches={num_micro_batches!r} is not a count of "
                             "micro-batches", where=where,
                             hint="pass an int >= 1, or None for gradient_accumulation_steps")
        if (self.is_first_stage() or self.is_last_stage()) and data_iter is None:
            raise UsageError("eval_batch() needs data_iter on the first and last stages",
                             where=where, hint="pass iter(your_loader)")
        return num_micro_batches or self._config.gradient_accumulation_steps

    def _forward_only(self, data_iter, m: int, compute_loss: bool):
        """Run :func:`.schedule.forward_only`; returns the last stage's per-micro-batch
        values (losses, or outputs without a loss) and its last outputs (else [], None)."""
        module: PipelineModule = self.module
        inputs: dict[int, Any] = {}
        labels: dict[int, Any] = {}
        outputs: dict[int, Any] = {}
        values, logits = [], None
        for action in S.forward_only(self.num_stages, self.stage_id, m):
            mb = cast(S.MicroBatchAction, action).mb
            if isinstance(action, S.LoadMicroBatch):
                self._load(data_iter, mb, inputs, labels)
            elif isinstance(action, S.RecvActivation):
                inputs[mb] = _recv(cast(int, self.grid.prev_stage_rank), self.device)
            elif isinstance(action, S.Forward):
                out = module(inputs.pop(mb))
                if not self.is_last_stage():
                    outputs[mb] = out
                    continue
                logits, label = out, labels.pop(mb)
                if compute_loss and module.loss_fn is not None:
                    out = module.loss_fn(out, label).float()
                values.append(out)
            elif isinstance(action, S.SendActivation):
                self._send_activation(outputs.pop(mb), cast(int, self.grid.next_stage_rank))
        return values, logits

    def _replica_mean(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The mean over micro-batches, then over the data-parallel replicas."""
        mean = torch.stack(values).mean(0)
        if self.dp_world_size > 1:
            dist.all_reduce(mean, group=self.strategy.group)
            mean /= self.dp_world_size
        return mean

    def _from_last_stage(self, value, listed: bool):
        """The last stage's ``value`` on every stage of this pipeline: a tensor, or (when
        ``listed``) a list of same-shaped tensors."""
        if self.num_stages == 1:
            return value
        src = self.grid.topology.stage_rank(dist.get_rank(), self.num_stages - 1)
        t = torch.stack(value) if listed and self.is_last_stage() else value
        if t is not None:
            t = t.contiguous()
        header = _header(t) if self.is_last_stage() else \
            torch.zeros(HEADER, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=src, group=self.grid.pipe_group)
        if not self.is_last_stage():
            t = _empty(header, self.device)
        dist.broadcast(t, src=src, group=self.grid.pipe_group)
        return list(t.unbind(0)) if listed else t

    def _load(self, data_iter, mb: int, inputs: dict, labels: dict) -> None:
        batch: Any = next(data_iter) if data_iter is not None else None
        if batch is not None and self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if self.is_first_stage():
            inputs[mb] = _to(batch[0], self.device)
        if self.is_last_stage():
            labels[mb] = _to(batch[1], self.device)

    def _send_activation(self, out, dst: int) -> None:
        if not torch.is_tensor(out):
            raise UsageError("a pipeline stage must pass one tensor to the next",
                             where=f"PipelineModule stage {self.stage_id}",
                             hint="return a single tensor from the last layer of each stage")
        _send(out.detach(), dst)

    def is_gradient_accumulation_boundary(self) -> bool:
        """In a pipeline every ``train_batch`` ends at a boundary (its last call to step)."""
        return True


def _to(x, device):
    return x.to(device) if torch.is_tensor(x) else x


def _header(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape and dtype as :data:`HEADER` int64s, for the receiver to allocate."""
    if t.dim() > HEADER - 2 or t.dtype not in DTYPES:
        raise UsageError(f"cannot pass a {t.dim()}-d {t.dtype} tensor between stages",
                         where="PipelineModule", hint=f"pass at most {HEADER - 2}-d tensors of "
                                                      "a float or int dtype")
    header = torch.zeros(HEADER, dtype=torch.int64, device=t.device)
    header[0], header[1] = t.dim(), DTYPES.index(t.dtype)
    header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def _empty(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    ndim, code = int(header[0]), int(header[1])
    return torch.empty(tuple(int(d) for d in header[2:2 + ndim]), dtype=DTYPES[code],
                       device=device)


def _send(t: torch.Tensor, dst: int) -> None:
    t = t.contiguous()
    dist.send(_header(t), dst)
    dist.send(t, dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    t = _empty(header, device)
    dist.recv(t, src)
    return t
