"""The shard plan of an HF-format save (pure): which state-dict keys go into which
weights file, named and split as transformers 5.23 / huggingface_hub do, and the index
file's text. :mod:`deepshard.integrations.hf_save` writes what this plans."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from deepshard.errors import UsageError

SAFE_WEIGHTS = "model.safetensors"
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's
_WHERE = "save_pretrained"


@dataclass(frozen=True)
class ShardFile:
    """One weights file: its name, the state-dict keys it holds (in order), their bytes."""

    name: str
    keys: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class ShardPlan:
    """The weights files of a save, in order; ``total_size`` is the index's
    ``metadata.total_size`` (bytes of every tensor)."""

    files: tuple[ShardFile, ...]
    total_size: int

    @property
    def is_sharded(self) -> bool:
        """Whether there is more than one file (and so an index)."""
        return len(self.files) > 1

    def weight_map(self) -> dict[str, str]:
        """The index's ``weight_map``: key -> file name."""
        return {key: f.name for f in self.files for key in f.keys}

    def rounds(self, world: int) -> list[range]:
        """File indices per round: round ``r`` holds files ``r*world .. r*world+world-1``,
        file ``k`` written by rank ``k % world``."""
        n = len(self.files)
        return [range(start, min(start + world, n)) for start in range(0, n, world)]


def parse_size(size: int | str) -> int:
    """Bytes of a ``max_shard_size``: an int, or digits and a unit (``"5GB"``, ``"20KB"``;
    decimal units as in huggingface_hub)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise UsageError(f"max_shard_size must be positive, got {size}", where=_WHERE)
        return size
    text = str(size).strip()
    unit = text[-2:].upper()
    try:
        value = float(text[:-2].strip())
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or value <= 0:
        raise UsageError(f"max_shard_size {size!r} is not a size", where=_WHERE,
                         hint='pass bytes (an int) or digits and a unit, e.g. "5GB", '
                              '"500MB" (units TB, GB, MB, KB)')
    return int(value * SIZE_UNITS[unit])


def plan_shards(sizes: Mapping[str, int], max_shard_size: int | str,
                weights_name: str = SAFE_WEIGHTS) -> ShardPlan:
    """Split ``sizes`` (key -> bytes, in state-dict order) into files as
    ``huggingface_hub.split_torch_state_dict_into_shards`` does: greedily in order, a new
    file when the next tensor would pass ``max_shard_size``, a tensor bigger than it alone
    in its own file. One file is named ``weights_name``; several are
    ``<stem>-0000K-of-0000N<ext>``."""
    limit = parse_size(max_shard_size)
    shards: list[dict[str, int]] = []
    current: dict[str, int] = {}
    current_size = 0
    for key, size in sizes.items():
        if size > limit:
            shards.append({key: size})
            continue
        if current_size + size > limit:
            shards.append(current)
            current, current_size = {}, 0
        current[key] = size
        current_size += size
    if current or not shards:
        shards.append(current)
    stem, dot, ext = weights_name.rpartition(".")
    names = [weights_name] if len(shards) == 1 else [
        f"{stem}-{k + 1:05d}-of-{len(shards):05d}{dot}{ext}" for k in range(len(shards))]
    files = tuple(ShardFile(name, tuple(shard), sum(shard.values()))
                  for name, shard in zip(names, shards, strict=True))
    return ShardPlan(files, sum(sizes.values()))


def index_json(weight_map: Mapping[str, str], total_size: int, total_parameters: int) -> str:
    """The text of ``model.safetensors.index.json``, byte for byte as transformers writes
    it."""
    index = {"metadata": {"total_parameters": total_parameters, "total_size": total_size},
             "weight_map": dict(weight_map)}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


# -- the public API ----------------------------------------------------------------------
