"""DeepSpeed's monitors (``deepspeed.monitor``): training scalars to CSV files, TensorBoard,
Weights & Biases and Comet, from rank 0.

The engine builds one :class:`~deepshard.monitor.monitor.MonitorMaster` from the config's
``csv_monitor``, ``tensorboard``, ``wandb`` and ``comet`` sections and hands it events
``(name, value, global_samples)`` at every optimizer step (see
:mod:`deepshard.runtime.engine_monitor` for which). The module names are DeepSpeed's, so
``from deepspeed.monitor.monitor import MonitorMaster`` works through the
``--deepspeed_compat`` shim.
"""
