"""The data-efficiency feature of one engine: what ``data_efficiency`` in the config does
to training.

- ``curriculum_learning``: ``initialize(training_data=...)`` returns a
  :class:`~deepshard.data_efficiency.loader.CurriculumLoader` (difficulty-ordered batches,
  the seqlen metrics applied to each);
- ``random_ltd``: before every training forward the kept-token schedule steps to the
  engine's global step (as DeepSpeed's ``_forward_prologue`` does) and its micro-step
  keys the draw of kept positions; the chosen layers, patched when the model was prepared
  (:mod:`.random_ltd`), read it;
- both states are in every checkpoint under DeepSpeed's names (``data_sampler``,
  ``random_ltd``), and a DeepSpeed checkpoint's load here.

Dynamic batching is built by the script, as in DeepSpeed
(:func:`deepshard.data_efficiency.dynamic_batching.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deepshard.data_efficiency.index_files import open_index
from deepshard.data_efficiency.loader import CurriculumLoader, PostProcess
from deepshard.data_efficiency.ltd_schedule import RandomLtdSchedule, RandomLtdSpec
from deepshard.data_efficiency.sampler import CurriculumSampler
from deepshard.errors import UsageError

NAME = "data_efficiency"
"""The feature's name, and the key of its state in deepshard's checkpoints."""


class DataEfficiency:
    """The engine's curriculum loader and random-LTD schedule (an
    :class:`~deepshard.runtime.extensions.EngineFeature`)."""

    name = NAME

    def __init__(self, section: Mapping[str, Any], ltd: RandomLtdSchedule | None,
                 curriculum: bool, module: Any):
        self.section, self.ltd, self.curriculum = section, ltd, curriculum
        self.module = module
        self.loader: CurriculumLoader | None = None
        self._pending: dict[str, Any] | None = None  # a sampler state loaded before a loader

    # -- the engine's hooks -------------------------------------------------------------
    def before_forward(self, engine: Any) -> None:
        """Step the kept-token schedule to the engine's global step (training only); refuse
        a curriculum whose loader the batches do not come from."""
        if self.curriculum and self.loader is None and engine.module.training:
            raise UsageError("curriculum learning is enabled but the batches do not come "
                             "from its loader", where="data_efficiency.data_sampling."
                             "curriculum_learning.enabled",
                             hint="pass training_data= to initialize (or build the loader "
                                  "with engine.deepspeed_io(dataset)), or disable it")
        if self.ltd is not None and engine.module.training:
            self.ltd.update_seq(engine.global_steps)
            self.ltd.position = engine.counters.micro_steps

    def training_loader(self, engine: Any, dataset: Any, collate_fn: Any) -> Any:
        """The curriculum's loader over ``dataset`` for this data-parallel rank; ``None``
        without a curriculum."""
        if not self.curriculum:
            return None
        sampling = self.section.get("data_sampling", {})
        sampler = CurriculumSampler.from_config(
            self.section, dataset_len=len(dataset),
            micro_batch_size=engine.train_micro_batch_size_per_gpu(),
            gradient_accumulation_steps=engine.gradient_accumulation_steps(),
            data_parallel_rank=engine.dp_rank, data_parallel_size=engine.dp_world_size,
            open_index=open_index)
        self.loader = CurriculumLoader(dataset, sampler, collate_fn,
                                       num_workers=int(sampling.get("num_workers", 0)),
                                       pin_memory=bool(sampling.get("pin_memory", False)))
        if self._pending is not None:
            self.loader.load_state_dict(self._pending)
            self._pending = None
        return self.loader

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's two checkpoint entries (``None`` where the part is off)."""
        return {"random_ltd": None if self.ltd is None else self.ltd.state_dict(),
                "data_sampler": None if self.loader is None else self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's entries (deepshard's or DeepSpeed's)."""
        if self.ltd is not None and state.get("random_ltd") is not None:
            self.ltd.load_state_dict(state["random_ltd"])
        sampler = state.get("data_sampler")
        if self.curriculum and sampler is not None:
            if self.loader is None:
                self._pending = sampler
            else:
                self.loader.load_state_dict(sampler)

    # -- DeepSpeed's engine methods -----------------------------------------------------
    def set_data_post_process_func(self, func: PostProcess) -> None:
        """``engine.set_data_post_process_func``: ``func(batch, sampler_state)`` replaces
        the default seqlen post-processing of the curriculum loader's batches."""
        if self.loader is not None:
            self.loader.post_process_func = func

    def random_ltd_initialize(self) -> None:
        """``engine.random_ltd_initialize``: bind the module's converted layers to the
        schedule (refused when the config does not enable random-LTD, as DeepSpeed)."""
        if self.ltd is None:
            raise UsageError("random_ltd_initialize() but random-LTD is not enabled",
                             where="data_efficiency.data_routing.random_ltd.enabled",
                             hint="enable it (with its schedule) in the config")
        from deepshard.data_efficiency.random_ltd import bind_random_ltd

        bind_random_ltd(self.module, self.ltd)

    def set_custom_curriculum_learning_schedule(
            self, schedule_func_dict: Mapping[str, Callable[[int], float]]) -> None:
        """``engine.set_custom_curriculum_learning_schedule``: the ``custom`` schedules'
        functions, by metric name."""
        if self.loader is not None:
            self.loader.data_sampler.set_custom_curriculum_learning_schedule(
                schedule_func_dict)


def attach(engine: Any) -> DataEfficiency | None:
    """The feature of ``engine`` when its config switches curriculum learning or random-LTD
    on (dynamic batching alone needs nothing of the engine)."""
    cfg = engine._config.data_efficiency
    sampling, routing = cfg.data_sampling, cfg.data_routing
    if not (sampling.curriculum_learning.enabled or routing.random_ltd.enabled):
        return None
    section = cfg.as_deepspeed()
    ltd = None
    if routing.random_ltd.enabled:
        spec = RandomLtdSpec.from_dict(section["data_routing"]["random_ltd"],
                                       global_batch_size=engine.train_batch_size())
        # keyed by the data-parallel rank: the tensor-parallel ranks of a group hold the
        # same tokens and must drop the same ones
        ltd = RandomLtdSchedule(spec, seed=cfg.seed, rank=engine.dp_rank)
        if engine.sequence_parallel_size > 1:
            raise UsageError("random-LTD with sequence parallelism is not supported (each "
                             "rank holds a part of the sequence)",
                             where="data_efficiency.data_routing.random_ltd.enabled",
                             hint="set sequence_parallel_size to 1, or disable random_ltd")
    if getattr(engine, "num_stages", 1) > 1:
        part = "data_routing.random_ltd" if ltd is not None else \
            "data_sampling.curriculum_learning"
        raise UsageError("curriculum learning and random-LTD are not supported with "
                         "pipeline parallelism", where=f"data_efficiency.{part}.enabled",
                         hint="train without pipeline stages, or disable it")
    made = DataEfficiency(section, ltd, sampling.curriculum_learning.enabled, engine.module)
    if ltd is not None:
        made.random_ltd_initialize()
    return made
