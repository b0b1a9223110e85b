"""``HfDeepShardConfig``: deepshard's ``transformers.integrations.HfDeepSpeedConfig``.

It holds a DeepSpeed-style config (a dict or a file in DeepSpeed's dialect) and answers the
questions transformers asks of one (``is_zero3()``, ``get_value("a.b")``, ...). While an
instance is alive, HF models built with ``from_pretrained``/``from_config`` come out already
partitioned at ZeRO stage 3 (see :mod:`deepshard.integrations.hf_loading`): keep a
reference to it, as with transformers' class, until the model is built.
"""

from __future__ import annotations

from typing import Any

from deepshard.config.dialect import read_config_source
from deepshard.errors import UsageError

OFFLOAD_DEVICES = frozenset({"cpu", "nvme"})


class HfDeepShardConfig:
    """A DeepSpeed config as transformers queries it (see the module docstring).

    Args:
        config_file_or_dict: a dict (deep-copied: the caller's is never modified) or the
            path of a JSON (comments allowed) or YAML config file.

    Raises:
        UsageError: the file cannot be read or parsed, or ``zero_optimization.stage`` is not
            one of 0-3.
    """

    def __init__(self, config_file_or_dict: Any):
        self.config, self.origin = read_config_source(config_file_or_dict)
        self._stage = self._read_stage()
        devices = {self.get_value("zero_optimization.offload_optimizer.device"),
                   self.get_value("zero_optimization.offload_param.device")}
        self._offload = self._stage >= 2 and bool(devices & OFFLOAD_DEVICES)
        from deepshard.integrations import hf_loading

        hf_loading.register(self)

    def _read_stage(self) -> int:
        stage = self.get_value("zero_optimization.stage", 0)
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise UsageError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}",
                             where=self.origin, hint='write e.g. "zero_optimization": '
                                                     '{"stage": 3}')
        return int(stage)

    # the questions transformers' HfDeepSpeedConfig answers, under the same names ----------
    def find_config_node(self, ds_key_long: str) -> tuple[dict | None, str]:
        """The mapping holding the last key of the dotted path, and that key (``None``
        when a parent is missing)."""
        node: Any = self.config
        *parents, key = ds_key_long.split(".")
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at the dotted path, or ``default`` when it is not set."""
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Remove the sub-tree at the dotted path (``must_exist``: raise when absent)."""
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise UsageError(f"{ds_key_long} is not in the config", where=self.origin,
                                 hint="check the key path")
            return
        del node[key]

    def is_true(self, ds_key_long: str) -> bool:
        """Whether the value is set and true."""
        return bool(self.get_value(ds_key_long))

    def is_false(self, ds_key_long: str) -> bool:
        """Whether the value is set and false (unset is neither true nor false)."""
        value = self.get_value(ds_key_long)
        return value is not None and not value

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        """Whether ZeRO 2/3 offloads the optimizer or the parameters to cpu or nvme."""
        return self._offload

    @property
    def stage(self) -> int:
        """``zero_optimization.stage`` (0 when unset)."""
        return self._stage
