"""``deepspeed.utils`` under deepshard's name: the logger, ``log_dist``, the ``safe_get_full_*``
parameter API, ``RepeatingLoader`` and ``zero_to_fp32``.

Re-exports only: the behaviour lives in :mod:`deepshard.runtime` (``runtime.utils``,
``runtime.checkpoint``) and in the engine's data-parallel strategy (``tensor_fragment``).
"""

from ..runtime.utils import RepeatingLoader
from .logging import log_dist, log_dist_once, logger, set_log_level_from_string
from .tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

__all__ = ["RepeatingLoader", "log_dist", "log_dist_once", "logger",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized", "set_log_level_from_string"]
