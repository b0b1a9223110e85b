"""The ``data_efficiency`` config section, as DeepSpeed 0.19.8 spells it.

Curriculum learning (``data_sampling.curriculum_learning``), dynamic batching
(``data_sampling.dynamic_batching``) and random layerwise token dropping
(``data_routing.random_ltd``); :mod:`deepshard.data_efficiency` implements them. As in
DeepSpeed, each switch is its own ``enabled`` key (the outer ``data_efficiency.enabled``,
``data_sampling.enabled`` and ``data_routing.enabled`` do not turn a switch off there; a
config where they disagree is refused here, since either reading would surprise someone).
The meaning checks that need more than one key (a schedule's own keys, layer ids against
the layer count) are the feature's, with the same key paths.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import model_validator

from deepshard.config.schema_base import (
    Bool,
    Int,
    KeyLog,
    NonNegInt,
    PosInt,
    Section,
    doc,
    one_of,
    validate_section,
)


class ScheduleConfig(Section):
    """A curriculum metric's ``schedule_config``: the keys of every schedule type (each
    type reads its own, :mod:`deepshard.data_efficiency.curriculum` checks them)."""

    difficulty: list[int | float] | None = doc("fixed_discrete: the difficulties, in order.",
                                         default=None)
    max_step: list[int] | None = doc("fixed_discrete: the last step of each difficulty but "
                                     "the last (one entry fewer).", default=None)
    total_curriculum_step: PosInt | None = doc("fixed_linear/fixed_root: steps from the "
                                               "min to the max difficulty.", default=None)
    difficulty_step: PosInt | None = doc("fixed_linear/fixed_root: every difficulty is a "
                                         "multiple of this.", default=None)
    root_degree: PosInt | None = doc("fixed_root: the root's degree (2: square root).",
                                     default=None)


class CurriculumMetricConfig(Section):
    """One metric of ``curriculum_metrics`` (its key is the metric's name:
    ``seqlen_truncate`` and ``seqlen_reshape`` are applied to each batch, any other names an
    index a data analyzer built)."""

    index_to_sample_path: str | None = doc("The analyzer's ``<metric>_index_to_sample`` "
                                           "files (path prefix of .bin/.idx).", default=None)
    index_to_metric_path: str | None = doc("The analyzer's ``<metric>_index_to_metric`` "
                                           "files (value-based difficulty).", default=None)
    difficulty_type: Annotated[Literal["value", "percentile"],
                               one_of("value", "percentile")] = doc(
        "Difficulties are metric values or percentiles of the samples.", default="value")
    clustering_type: Annotated[Literal["single_cluster", "schedule_based"],
                               one_of("single_cluster", "schedule_based")] = doc(
        "single_cluster: the metric filters no sample (the seqlen metrics); schedule_based: "
        "each difficulty adds a cluster of eligible samples.", default="single_cluster")
    min_difficulty: int | float = doc("The first difficulty.")
    max_difficulty: int | float = doc("The last difficulty.")
    schedule_type: Annotated[Literal["fixed_discrete", "fixed_linear", "fixed_root",
                                     "custom"],
                             one_of("fixed_discrete", "fixed_linear", "fixed_root",
                                    "custom")] = doc("How the difficulty grows with steps.")
    schedule_config: ScheduleConfig = doc("The schedule's parameters.",
                                          default_factory=ScheduleConfig)


class CurriculumConfig(Section):
    """``data_sampling.curriculum_learning``."""

    enabled: Bool = doc("Sample by difficulty, easiest first.", default=False)
    data_cluster_path: str | None = doc("Where the sampler may write its clusters (DeepSpeed "
                                        "writes them there; deepshard keeps them in memory "
                                        "and writes them only when this is set).",
                                        default=None)
    curriculum_metrics: dict[str, CurriculumMetricConfig] = doc(
        "The metrics, by name.", default_factory=dict)

    @classmethod
    def prepare(cls, data: dict[str, Any], log: KeyLog) -> dict[str, Any]:
        metrics = data.get("curriculum_metrics")
        if isinstance(metrics, dict):  # each metric validated under its own name's path
            data = {**data, "curriculum_metrics": {
                str(name): validate_section(CurriculumMetricConfig, value, log,
                                            "curriculum_metrics", str(name))
                for name, value in metrics.items()}}
        return data

    @model_validator(mode="after")
    def _metrics_when_enabled(self) -> CurriculumConfig:
        if self.enabled and not self.curriculum_metrics:
            raise ValueError("curriculum_learning is enabled but curriculum_metrics is empty "
                             "(add e.g. {\"seqlen_truncate\": {...}})")
        return self


class DynamicBatchingConfig(Section):
    """``data_sampling.dynamic_batching``: batches of at most ``max_tokens`` tokens."""

    enabled: Bool = doc("Build batches to a token budget.", default=False)
    metrics_path: str | None = doc("Where the ``seqlen`` metric of a data analyzer is (or is "
                                   "written when missing).", default=None)
    lr_scaling_method: Annotated[Literal["linear", "sqrt", "none"],
                                 one_of("linear", "sqrt", "none", case_insensitive=True)] = doc(
        "How the learning rate follows each batch's size.", default="linear")
    min_batch_size: PosInt = doc("Fewest samples of a micro-batch.", default=1)
    max_batch_size: PosInt | None = doc("Most samples of a micro-batch.", default=None)
    sequence_picking_order: Annotated[Literal["random", "seqlen", "dataloader"],
                                      one_of("random", "seqlen", "dataloader")] = doc(
        "The order samples are packed in.", default="dataloader")
    max_tokens: PosInt | None = doc("Tokens of a micro-batch at most (required when "
                                    "enabled).", default=None)
    verbose: Bool = doc("Log each batch's make-up.", default=False)

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> DynamicBatchingConfig:
        if self.enabled and self.max_tokens is None:
            raise ValueError("dynamic_batching is enabled but max_tokens is not set")
        return self


class DataSamplingConfig(Section):
    """``data_efficiency.data_sampling``."""

    enabled: Bool = doc("DeepSpeed's switch of the section (each part has its own).",
                        default=False)
    num_epochs: PosInt = doc("Epochs the curriculum sampler may draw.", default=1000)
    num_workers: NonNegInt = doc("Loader worker processes.", default=0)
    pin_memory: Bool = doc("Pinned host memory for batches.", default=False)
    curriculum_learning: CurriculumConfig = doc("Curriculum learning.",
                                                default_factory=CurriculumConfig)
    dynamic_batching: DynamicBatchingConfig = doc("Dynamic batching.",
                                                  default_factory=DynamicBatchingConfig)


class LtdScheduleParams(Section):
    """``random_ltd_schedule.schedule_config``."""

    require_steps: PosInt = doc("Steps from min_value to max_value kept tokens.")
    seq_per_step: PosInt = doc("Kept-token counts are multiples of this.", default=1)


class LtdScheduleConfig(Section):
    """``random_ltd.random_ltd_schedule``: how many tokens the chosen layers keep."""

    min_value: PosInt = doc("Tokens kept at the first step.")
    max_value: PosInt = doc("Tokens kept at the end (the sequence length: no dropping).")
    schedule_type: Annotated[Literal["fixed_linear"], one_of("fixed_linear")] = doc(
        "The only schedule DeepSpeed has.", default="fixed_linear")
    schedule_config: LtdScheduleParams = doc("The schedule's parameters.")


class LayerTokenLrConfig(Section):
    """``random_ltd.layer_token_lr_schedule``: DeepSpeed raises NotImplementedError when it
    is enabled; deepshard refuses it."""

    enabled: Bool = doc("Not implemented (by DeepSpeed either): must stay false.",
                        default=False)
    total_layer_tokens: Int | None = doc("Unused.", default=None)
    warmup_type: str | None = doc("Unused.", default=None)
    warmup_layer_tokens: Int | None = doc("Unused.", default=None)

    @model_validator(mode="after")
    def _refused(self) -> LayerTokenLrConfig:
        if self.enabled:
            raise ValueError("the layer-token learning-rate schedule is not implemented "
                             "(DeepSpeed raises NotImplementedError too); set enabled to "
                             "false and use the scheduler section")
        return self


class RandomLtdConfig(Section):
    """``data_routing.random_ltd``: random layerwise token dropping."""

    enabled: Bool = doc("Drop tokens in the chosen layers.", default=False)
    total_layer_num: PosInt | None = doc("The model's transformer layers.", default=None)
    random_ltd_layer_num: NonNegInt | None = doc("How many layers drop tokens.",
                                                 default=None)
    random_ltd_layer_id: list[int] = doc("Which layers (0-based) drop tokens.",
                                         default_factory=list)
    model_mask_name: str | None = doc("The keyword the layers get their attention mask "
                                      "as (None: no mask keyword).", default=None)
    model_type: Annotated[Literal["decoder", "encoder"], one_of("decoder", "encoder")] = doc(
        "decoder: kept tokens keep their order under a causal mask.", default="decoder")
    hidden_state_order: Annotated[Literal["batch_seq_dim", "seq_batch_dim"],
                                  one_of("batch_seq_dim", "seq_batch_dim")] = doc(
        "The layers' hidden-state layout.", default="batch_seq_dim")
    micro_batch_size: PosInt | None = doc("Set from the batch triad (as DeepSpeed).",
                                          default=None)
    global_batch_size: PosInt | None = doc("Set from the batch triad (as DeepSpeed).",
                                           default=None)
    random_ltd_schedule: LtdScheduleConfig | None = doc("The kept-token schedule.",
                                                        default=None)
    layer_token_lr_schedule: LayerTokenLrConfig = doc(
        "Not implemented (refused when enabled).", default_factory=LayerTokenLrConfig)

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> RandomLtdConfig:
        if self.enabled:
            missing = [k for k in ("total_layer_num", "random_ltd_layer_num",
                                   "random_ltd_schedule") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"random_ltd is enabled but {', '.join(missing)} "
                                 f"{'is' if len(missing) == 1 else 'are'} not set")
        return self


class DataRoutingConfig(Section):
    """``data_efficiency.data_routing``."""

    enabled: Bool = doc("DeepSpeed's switch of the section (random_ltd has its own).",
                        default=False)
    random_ltd: RandomLtdConfig = doc("Random layerwise token dropping.",
                                      default_factory=RandomLtdConfig)


class DataEfficiencyConfig(Section):
    """``data_efficiency``: DeepSpeed's data-efficiency library."""

    enabled: Bool = doc("DeepSpeed's switch of the section (each part has its own).",
                        default=False)
    seed: Int = doc("Seed of the curriculum sampler's and dynamic batching's orders.",
                    default=1234)
    data_sampling: DataSamplingConfig = doc("Curriculum learning and dynamic batching.",
                                            default_factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = doc("Random-LTD.", default_factory=DataRoutingConfig)

    @model_validator(mode="after")
    def _switches_agree(self) -> DataEfficiencyConfig:
        sampling, routing = self.data_sampling, self.data_routing
        parts = {"data_sampling.curriculum_learning": (sampling.curriculum_learning.enabled,
                                                       sampling.enabled),
                 "data_sampling.dynamic_batching": (sampling.dynamic_batching.enabled,
                                                    sampling.enabled),
                 "data_routing.random_ltd": (routing.random_ltd.enabled, routing.enabled)}
        for path, (on, section_on) in parts.items():
            if on and not (section_on and self.enabled):
                outer = path.split(".")[0]
                raise ValueError(f"{path}.enabled is true but data_efficiency.enabled or "
                                 f"{outer}.enabled is false (DeepSpeed would run it "
                                 "anyway); set all three to true, or the part's to false")
        return self

    def any_enabled(self) -> bool:
        """Whether any part is switched on."""
        return (self.data_sampling.curriculum_learning.enabled
                or self.data_sampling.dynamic_batching.enabled
                or self.data_routing.random_ltd.enabled)

    def as_deepspeed(self) -> dict[str, Any]:
        """The section as the dict DeepSpeed's ``engine.data_efficiency_config()`` returns
        (defaults filled in, unset optional keys left out)."""
        return self.model_dump(mode="python", exclude_none=True)
