"""Pickling DeepSpeed's own classes without DeepSpeed, for the files deepshard writes in
DeepSpeed's layout.

DeepSpeed's checkpoints hold a few of its objects (a ``LossScaler``, the ``ZeroStageEnum``,
``fragment_address`` records); its loader uses them as objects, so a file it is to read
must name them by their DeepSpeed class. :func:`instance` makes a stand-in
(:class:`~.ds_files.Foreign`, the same class reading uses) and :func:`pickle_module`
is the ``pickle_module`` for ``torch.save`` that writes a stand-in as DeepSpeed's class:
an object with its attributes, or an enum member by its value.
"""

from __future__ import annotations

import copyreg
import pickle
import types
from typing import Any

from deepshard.runtime.checkpoint.ds_files import Foreign

LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"


def instance(ds_class: str, *args: Any, **state: Any) -> Foreign:
    """A stand-in for an object of DeepSpeed's ``ds_class`` (a dotted path): an enum
    member built from ``args`` (its value), or an object whose attributes are ``state``."""
    cls = type(ds_class.rpartition(".")[2], (Foreign,), {"ds_class": ds_class})
    obj = cls(*args)
    obj.__dict__.update(state)
    return obj


class _Pickler(pickle._Pickler):  # the Python pickler: its save_global can be replaced
    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Foreign):
            return NotImplemented
        if getattr(obj, "args", ()):  # an enum member: DeepSpeed's class called with its value
            return type(obj), tuple(obj.args)
        state = {k: v for k, v in obj.__dict__.items() if k not in ("args", "kwargs")}
        return copyreg.__newobj__, (type(obj),), state  # type: ignore[attr-defined]

    def save_global(self, obj: Any, name: str | None = None) -> None:
        ds_class = getattr(obj, "ds_class", "") if isinstance(obj, type) else ""
        if not (isinstance(obj, type) and issubclass(obj, Foreign) and ds_class):
            super().save_global(obj, name)  # type: ignore[misc]
            return
        module, _, qualname = ds_class.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]


def pickle_module() -> types.ModuleType:
    """The ``pickle_module`` for ``torch.save`` writing stand-ins as DeepSpeed's classes."""
    mod = types.ModuleType("deepshard_ds_pickle_out")
    mod.Pickler = _Pickler  # type: ignore[attr-defined]
    mod.dump = pickle.dump  # type: ignore[attr-defined]
    mod.__dict__["dumps"] = pickle.dumps
    return mod
