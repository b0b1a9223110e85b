"""Checkpoints: the file format, the engine's save and load, ZeRO shards, model-parallel
merges and consolidation, one module each.

- :mod:`.format`: one directory per tag, a JSON manifest, atomic commit, ``latest``;
- :mod:`.by_name`: every checkpoint read back by parameter name, the form loads go through;
- :mod:`.zero_shards`: what a ZeRO rank writes of its shards and reads back;
- :mod:`.model_parallel`: pipeline / tensor-parallel layouts, merged when consolidating;
- :mod:`.consolidate`: :func:`get_fp32_state_dict`;
- :mod:`.engine_io`: ``engine.save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model``
  over the engine's public state and its data-parallel strategy.

The format's names are re-exported here (``checkpoint.Manifest``, ``checkpoint.LATEST``...).
"""

from deepshard.runtime.checkpoint.format import (
           LATEST,
           MANIFEST,
           SHARED_FILE,
           Manifest,
           check_tag,
           complete_tags,
           full_precision,
           load_file,
           rank_file,
           read_manifest,
           resolve_tag,
           rng_states,
           save,
           set_rng_states,
)

__all__ = ["LATEST", "MANIFEST", "SHARED_FILE", "Manifest", "check_tag", "complete_tags",
           "full_precision", "load_file", "rank_file", "read_manifest", "resolve_tag",
           "rng_states", "save", "set_rng_states"]
