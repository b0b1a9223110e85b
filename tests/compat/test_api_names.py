"""Every DeepSpeed name issue 18 lists (the ones DeepSpeedExamples and the HF/Accelerate
integrations import) resolves through the ``--deepspeed_compat`` shim to the deepshard
object the path table (``deepshard.compat.paths``) names for it, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

from deepshard.contract import SHIM_DIR

NAMES = [
    "initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine",
    "PipelineEngine", "PipelineModule", "get_accelerator", "log_dist", "logger", "zero.Init",
    "zero.GatheredParameters", "checkpointing.checkpoint", "comm.get_rank",
    "comm.get_world_size", "comm.get_local_rank", "comm.get_global_rank", "comm.barrier",
    "comm.all_reduce", "comm.is_initialized", "comm.log_summary",
    "accelerator.get_accelerator", "pipe.PipelineModule", "pipe.LayerSpec",
    "pipe.TiedLayerSpec", "utils.RepeatingLoader", "utils.safe_get_full_fp32_param",
    "utils.safe_get_full_grad", "utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "utils.zero_to_fp32.load_state_dict_from_zero_checkpoint", "ops.adam.FusedAdam",
    "ops.adam.DeepSpeedCPUAdam", "ops.lamb.FusedLamb", "runtime.utils.set_random_seed",
    "runtime.utils.see_memory_usage", "profiling.flops_profiler.get_model_profile",
    "runtime.engine.DeepSpeedEngine", "runtime.pipe.engine.PipelineEngine",
    "runtime.zero.partition_parameters.ZeroParamStatus", "runtime.lr_schedules.WarmupLR",
    "runtime.lr_schedules.VALID_LR_SCHEDULES", "checkpoint.utils.clone_tensors_for_torch_save",
    "moe.utils.split_params_into_different_moe_groups_for_optimizer",
    "moe.layer.MoE", "moe.sharded_moe.TopKGate", "moe.sharded_moe.MOELayer",
    "moe.sharded_moe.top1gating", "moe.sharded_moe.top2gating", "moe.sharded_moe.topkgating",
    "moe.experts.Experts", "moe.utils.is_moe_param",
    "monitor.monitor.MonitorMaster", "monitor.monitor.Monitor", "monitor.csv_monitor.csvMonitor",
    "monitor.tensorboard.TensorBoardMonitor", "monitor.wandb.WandbMonitor",
    "monitor.comet.CometMonitor", "monitor.config.get_monitor_config",
    "monitor.config.DeepSpeedMonitorConfig",
    "runtime.fp16.onebit.adam.OnebitAdam", "runtime.fp16.onebit.zoadam.ZeroOneAdam",
    "runtime.fp16.onebit.lamb.OnebitLamb",
    "sequence.layer.DistributedAttention", "sequence.layer._SeqAllToAll",
    "runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF",
    "runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter",
    "runtime.sequence_parallel.ulysses_sp.TiledMLP",
    "runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss",
]

PROBE = """
import importlib, inspect, json, sys
import deepspeed
from deepshard.compat.alias import resolve
out = {}
for name in sys.argv[1:]:
    mod, _, attr = name.rpartition(".")
    ds = importlib.import_module("deepspeed." + mod) if mod else deepspeed
    got = getattr(ds, attr)
    # the object the path table names for it, and one of deepshard's own
    ours = not (inspect.isclass(got) or inspect.isfunction(got)) or (
        got.__module__.startswith("deepshard"))
    out[name] = got is resolve("deepspeed." + name) and ours
print(json.dumps(out))
"""


def test_every_listed_deepspeed_name_is_the_deepshard_object():
    result = subprocess.run([sys.executable, "-c", PROBE, *NAMES], capture_output=True,
                            text=True, timeout=120, env={"PYTHONPATH": SHIM_DIR,
                                                         "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    same = json.loads(result.stdout)
    assert same == dict.fromkeys(NAMES, True)
