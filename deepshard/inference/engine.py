"""``InferenceEngine``: the model ``init_inference`` returns, DeepSpeed's interface.

It is an ``nn.Module`` holding the sharded model as :attr:`module`; ``engine(...)`` is the
model's forward and :meth:`generate` HF's ``generate`` with its KV cache, checked against
``max_out_tokens``. Unlike DeepSpeed's, it also answers the model's own attributes
(``config``, ``device``, ``generation_config``, ``can_generate`` ...), so an HF pipeline whose
``model`` is replaced by the engine keeps working, and it runs beam search.

Every rank of a tensor-parallel group must call it with the same inputs; greedy and beam
search then give the same tokens on every rank (the layers' collectives leave identical
bits). Sampling also needs the same random numbers: :meth:`generate` checks that the
group's random states agree and, when they do not, gives every rank the first rank's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepshard.errors import UsageError


class InferenceEngine(nn.Module):
    """A model prepared by :func:`~deepshard.inference.api.init_inference`."""

    def __init__(self, module: nn.Module, config: Any, group: Any = None,
                 report: Any = None) -> None:
        super().__init__()
        self.module = module
        self._config = config
        self._group = group
        self.report = report
        """The :class:`~.sharding.ShardReport` of this rank (plan, local bytes)."""
        self._profile = False
        self._times: list[float] = []

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    @property
    def config(self) -> Any:
        """The model's config (HF's ``PretrainedConfig``); the engine's own settings are
        :attr:`inference_config`."""
        return getattr(self.module, "config", None)

    @property
    def inference_config(self) -> Any:
        """The parsed ``init_inference`` settings."""
        return self._config

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's forward; timed when :meth:`profile_model_time` is on."""
        start = time.perf_counter()
        out = self.module(*inputs, **kwargs)
        if self._profile:
            self._times.append((time.perf_counter() - start) * 1e3)
        return out

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """HF ``generate`` on the sharded model (greedy, sampling, beam search)."""
        ids = kwargs.get("input_ids", inputs[0] if inputs else None)
        limit = self._config.max_out_tokens
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[-1] > limit:
            raise UsageError(f"the input has {ids.shape[-1]} tokens, more than max_out_tokens="
                             f"{limit}", where="init_inference: max_out_tokens",
                             hint="raise max_out_tokens in the inference config")
        gen = kwargs.get("generation_config")
        if kwargs.get("do_sample", getattr(gen, "do_sample", False)):
            self._agree_on_random_state()
        start = time.perf_counter()
        out = self.module.generate(*inputs, **kwargs)
        if self._profile:
            self._times.append((time.perf_counter() - start) * 1e3)
        return out

    def _agree_on_random_state(self) -> None:
        if self._group is None or not dist.is_initialized() or dist.get_world_size(
                self._group) == 1:
            return
        state = torch.get_rng_state()
        states = [torch.empty_like(state) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(states, state, group=self._group)
        if any(not torch.equal(s, states[0]) for s in states):
            torch.set_rng_state(states[0])

    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Record the wall time of every forward / generate call (ms), read with
        :meth:`model_times`."""
        del use_cuda_events
        self._profile = True

    def model_times(self) -> list[float]:
        """The recorded times in ms since the last call (emptied), as DeepSpeed's."""
        times, self._times = self._times, []
        return times

    def destroy(self) -> None:
        """Drop the model and the tensor-parallel group's reference (DeepSpeed frees its
        kernel workspace here)."""
        self._modules.pop("module", None)
        self._group = None
