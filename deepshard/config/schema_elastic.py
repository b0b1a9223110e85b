"""The ``elasticity`` config section: DeepSpeed's keys and defaults (as of 0.18.9, the last
release that had it; 0.19 rejects the section).

``{"elasticity": {"enabled": true, "max_train_batch_size": 2000, "micro_batch_sizes":
[2, 4, 6], "min_gpus": 1, "max_gpus": 10000, "min_time": 20, "version": 0.1}}``. When
enabled, the batch triad is :func:`deepshard.elasticity.compute`'s for the world size
(``deepshard.config.resolve``), and ``ds-run --elastic_training`` starts only the
world sizes it allows.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from deepshard.config.schema_base import Bool, NonNegFloat, PosFloat, PosInt, Section, doc
from deepshard.elasticity import ElasticSpec


def _sizes(value: Any) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return tuple(value)
    raise PydanticCustomError("expected", "expected {kind}",
                              {"kind": "a non-empty list of positive integers (e.g. [2, 4])"})


MicroBatches = Annotated[tuple[int, ...], BeforeValidator(_sizes)]


class ElasticityConfig(Section):
    """``elasticity``: one train batch size that a range of world sizes share."""

    enabled: Bool = doc("Compute the batch triad from this section.", default=False)
    max_train_batch_size: PosInt = doc("The largest train batch size to choose.",
                                       default=2000)
    micro_batch_sizes: MicroBatches = doc("Micro batch sizes a rank may run.",
                                          default=(2, 4, 6))
    min_gpus: PosInt = doc("The fewest GPUs (ranks) to allow.", default=1)
    max_gpus: PosInt = doc("The most GPUs (ranks) to allow.", default=10000)
    min_time: NonNegFloat = doc("Minutes a scheduler should keep one size (a hint; no "
                                "effect on the arithmetic).", default=0)
    version: PosFloat = doc("0.1, or 0.2 (per node, with model parallelism).", default=0.2)
    prefer_larger_batch: Bool = doc("On a tie, the larger train batch.", default=True)
    ignore_non_elastic_batch_info: Bool = doc(
        "Let the section override a batch triad that is also written (otherwise that is "
        "an error, as in DeepSpeed).", default=False)
    model_parallel_size: PosInt = doc("Ranks of one model-parallel group (version 0.2).",
                                      default=1)
    num_gpus_per_node: PosInt = doc("GPUs per node (version 0.2).", default=1)

    def spec(self) -> ElasticSpec:
        """The pure arithmetic's input."""
        return ElasticSpec(**self.model_dump())
