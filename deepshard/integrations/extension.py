"""The HF integration's hook into the runtime (the ``deepshard.extensions`` entry point
``hf``): the engine's ``save_pretrained`` and DeepSpeed's
``_zero3_consolidated_16bit_state_dict`` (what HF's Trainer and Accelerate call) are
:mod:`deepshard.integrations.hf_save`'s."""

from __future__ import annotations

from typing import Any

from deepshard.runtime.extensions import Extension


def _save_pretrained(engine: Any, save_directory: Any, **kwargs: Any) -> None:
    from deepshard.integrations.hf_save import save_pretrained

    save_pretrained(engine, save_directory, **kwargs)


def _consolidated(engine: Any, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    from deepshard.integrations.hf_save import consolidated_16bit_state_dict

    return consolidated_16bit_state_dict(engine, exclude_frozen_parameters)


EXTENSION = Extension(name="hf", engine_exports={
    "save_pretrained": _save_pretrained,
    "consolidated_16bit_state_dict": _consolidated,
})
