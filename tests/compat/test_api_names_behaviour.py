"""The DeepSpeed 0.19.8 names of issue 41's list, used under the ``--deepspeed_compat`` alias
and checked against what DeepSpeed 0.19.8 measured (``/tmp/ds41/FINDINGS.md`` section 15):
each resolves, and does what DeepSpeed's does.

One interpreter runs every probe (this file run as a script, ``import deepspeed`` being the
shim, gloo with one rank for the probes that need a process group) and prints their results
as JSON; the tests read them. The MiCS probe runs first: the alias explains
``deepspeed.zero.MiCS_Init`` only while ``deepspeed.zero`` is the first name deepshard's
ZeRO package was imported under (see the report in ``docs/deepspeed-api.md``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROBES: dict[str, Any] = {}


def probe(fn):
    PROBES[fn.__name__] = fn
    return fn


@probe
def mics():
    out = []
    try:
        from deepspeed.zero import MiCS_Init  # noqa: F401
    except ImportError as exc:
        out.append(str(exc))
    try:
        import deepspeed.runtime.zero.mics  # noqa: F401
    except ImportError as exc:
        out.append(str(exc))
    return out


@probe
def resolution():
    """Each name is deepshard's object, the one the path table names."""
    import importlib

    from deepshard.compat.alias import resolve
    names = ["OnDevice", "utils.OnDevice", "utils.init_on_device.OnDevice",
             "runtime.config_utils.DeepSpeedConfigModel", "runtime.constants.TRAIN_BATCH_SIZE",
             "runtime.precision_config.DeepSpeedBF16Config",
             "runtime.zero.config.DeepSpeedZeroConfig", "runtime.zero.config.ZeroStageEnum",
             "runtime.zero.unwrap_model_for_generation", "runtime.zero.tiling.TiledLinear",
             "runtime.pipe.topology.ProcessTopology", "runtime.pipe.schedule.TrainSchedule",
             "runtime.activation_checkpointing.checkpointing.non_reentrant_checkpoint",
             "utils.comms_logging.CommsLogger", "utils.timer.SynchronizedWallClockTimer",
             "utils.torch.required_torch_version", "utils.nvtx.instrument_w_nvtx",
             "utils.zero_to_fp32.get_optim_files", "ops.op_builder.CPUAdamBuilder",
             "ops.__compatible_ops__"]
    out = {}
    for name in names:
        module, _, attr = f"deepspeed.{name}".rpartition(".")
        got = getattr(importlib.import_module(module), attr)
        out[name] = got is resolve(f"deepspeed.{name}") and (
            not hasattr(got, "__module__") or got.__module__.startswith("deepshard"))
    return out


@probe
def on_device():
    import deepspeed
    import torch
    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(4, 4)
        ints = torch.arange(3)
    with deepspeed.OnDevice(dtype=torch.bfloat16, device="cpu", enabled=False):
        off = torch.nn.Linear(2, 2)
    return [str(layer.weight.device), str(layer.weight.dtype), str(ints.dtype),
            str(torch.get_default_dtype()), str(torch.empty(1).device), str(off.weight.dtype)]


@probe
def config_utils():
    from deepspeed.runtime.config_utils import (
        DeepSpeedConfigModel,
        dict_raise_error_on_duplicate_keys,
        get_scalar_param,
    )

    class Section(DeepSpeedConfigModel):
        size: int = 3
        name: str = "x"

    errors = []
    for build in (lambda: Section(bogus=1), lambda: setattr(Section(), "size", "many"),
                  lambda: json.loads('{"a": 1, "a": 2}',
                                     object_pairs_hook=dict_raise_error_on_duplicate_keys)):
        try:
            build()
        except ValueError as exc:
            errors.append(str(exc))
    cfg = {k: v for k, v in DeepSpeedConfigModel.model_config.items()
           if k in ("extra", "validate_assignment", "use_enum_values", "populate_by_name",
                    "validate_default", "arbitrary_types_allowed")}
    return {"auto": Section(size="auto").size, "errors": errors, "config": cfg,
            "scalar": [get_scalar_param({"a": 1}, "a", 0), get_scalar_param({}, "a", 0)]}


@probe
def constants():
    import deepspeed.runtime.constants as c
    keys = ["TRAIN_BATCH_SIZE", "TRAIN_MICRO_BATCH_SIZE_PER_GPU", "GRADIENT_ACCUMULATION_STEPS",
            "OPTIMIZER", "SCHEDULER", "GRADIENT_CLIPPING", "GRADIENT_CLIPPING_DEFAULT",
            "STEPS_PER_PRINT_DEFAULT", "ZERO_ALLOW_UNTESTED_OPTIMIZER", "BFLOAT16", "FP16",
            "DATA_TYPES", "GRAD_ACCUM_DTYPE", "GRADIENT_ALLREDUCE_OP", "CHECKPOINT",
            "CHECKPOINT_TAG_VALIDATION", "ROUTE_TRAIN", "PIPE_REPLICATED", "DATA_PARALLEL_GROUP",
            "GLOBAL_RANK"]
    return {"values": {k: getattr(c, k) for k in keys},
            "upper": len([n for n in dir(c) if n.isupper()])}


@probe
def precision():
    from deepspeed.runtime.precision_config import (
        DeepSpeedBF16Config,
        DeepSpeedFP16Config,
        get_bfloat16_config,
        get_float16_config,
    )
    return [DeepSpeedBF16Config().model_dump(), DeepSpeedFP16Config().model_dump(),
            get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled,
            get_float16_config({"fp16": {"initial_scale_power": 8}}).initial_dynamic_scale()]


@probe
def zero_config():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import (
        DeepSpeedZeroConfig,
        OffloadDeviceEnum,
        ZeroStageEnum,
    )
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum as Offload

    config = DeepSpeedZeroConfig(stage=3, offload_param={"device": "cpu"})
    ds = DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    return {"stages": {m.name: int(m) for m in ZeroStageEnum},
            "max_stage": ZeroStageEnum.max_stage is ZeroStageEnum.weights,
            "stage3": config.stage == ZeroStageEnum.weights,
            "offload": config.offload_param.device == OffloadDeviceEnum.cpu,
            "same_enum": OffloadDeviceEnum is Offload,
            "engine_config": isinstance(ds.zero_config, DeepSpeedZeroConfig),
            "defaults": [DeepSpeedZeroConfig().reduce_bucket_size,
                         DeepSpeedZeroConfig().sub_group_size]}


@probe
def tiled_linear():
    import torch
    from deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias
    torch.manual_seed(0)
    tiled = TiledLinear(6, 4, True, 2, 2)
    plain = torch.nn.Linear(6, 4)
    tiled.copy_params_from(plain)
    x = torch.randn(3, 6)
    y = tiled(x)
    y.sum().backward()

    class ReturnsBias(torch.nn.Linear):
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight), self.bias

    ret = TiledLinearReturnBias(6, 4, True, 2, 2, linear_cls=ReturnsBias, init_linear=plain)
    out, bias = ret(x)
    return {"grid": [[(t.in_features, t.out_features, t.bias is not None) for t in row]
                     for row in tiled.linears],
            "shape": list(y.shape), "diff": (y - plain(x)).abs().max().item(),
            "grads": all(t.weight.grad is not None for row in tiled.linears for t in row),
            "return_bias": [(out + bias - plain(x)).abs().max().item(), list(bias.shape)]}


@probe
def topology():
    from deepspeed.runtime.pipe.topology import (
        PipeDataParallelTopology,
        PipeModelDataParallelTopology,
        ProcessTopology,
    )
    out = {}
    for name, topo in (("process", ProcessTopology(["pipe", "data"], [2, 3])),
                       ("pipe_data", PipeDataParallelTopology(num_pp=2, num_dp=3))):
        out[name] = [topo.world_size(), topo.get_rank(pipe=1, data=2), repr(topo.get_coord(4)),
                     topo.get_axis_comm_lists("data"), topo.filter_match(pipe=0),
                     topo.get_axis_list("pipe", 1), topo.get_rank_repr(4), topo.get_dim("model"),
                     topo.get_axis_names()]
    pmd = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    out["pmd"] = [pmd.get_axis_names(), pmd.get_axis_comm_lists("pipe"),
                  pmd.filter_match(pipe=0, data=1), pmd.get_rank_repr(3)]
    try:
        ProcessTopology(["x", "y"], [2, 3]).get_rank(x=1)
    except ValueError as exc:
        out["slice"] = str(exc)
    return out


@probe
def schedule():
    from deepspeed.runtime.pipe import schedule as s
    train = s.TrainSchedule(micro_batches=2, stages=2, stage_id=0)
    return {"train0": [[repr(i) for i in step] for step in train],
            "train1": [[repr(i) for i in step] for step in s.TrainSchedule(2, 2, 1)],
            "infer1": [[repr(i) for i in step] for step in s.InferenceSchedule(2, 2, 1)],
            "dp": [[repr(i) for i in step] for step in s.DataParallelSchedule(2, 1, 0)],
            "buffers": [train.num_pipe_buffers(), s.TrainSchedule(8, 4, 1).num_pipe_buffers()],
            "bases": [issubclass(c, s.BufferOpInstruction) for c in (
                s.LoadMicroBatch, s.ForwardPass, s.BackwardPass, s.SendActivation,
                s.RecvActivation, s.SendGrad, s.RecvGrad)] + [
                issubclass(c, s.PipeInstruction) for c in (
                    s.OptimizerStep, s.ReduceGrads, s.ReduceTiedGrads)],
            "attr": s.ForwardPass(3).buffer_id}


@probe
def non_reentrant():
    import torch
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
    x = torch.arange(4.0, requires_grad=True)
    non_reentrant_checkpoint(lambda t: (t * t).sin(), x).sum().backward()
    want = (2 * x * (x * x).cos()).detach()
    return (x.grad - want).abs().max().item()


@probe
def comms_logger():
    from deepspeed.utils.comms_logging import CommsLogger
    log = CommsLogger()
    before = [log.comms_dict, log.prof_ops, log.prof_all, log.enabled, log.verbose,
              log.debug, log.has_data()]
    log.append("all_reduce", "all_reduce", 2.0, 1024)
    after = [log.has_data(), sorted(log.get_raw_data())]
    log.reset_data()
    return before + after + [log.has_data()]


@probe
def timers():
    import time
    from types import SimpleNamespace

    from deepspeed.utils import timer
    timers = timer.SynchronizedWallClockTimer()
    timers("fwd").start()
    time.sleep(0.02)
    timers("fwd").stop()
    elapsed = timers("fwd").elapsed(reset=False)
    means = timers.get_mean(["fwd"])
    timers.log(["fwd"])  # and resets the timer
    noop = timer.NoopTimer()
    noop("x").start()
    noop("x").stop()
    meter = timer.ThroughputTimer(SimpleNamespace(enabled=True, synchronized=False),
                                  batch_size=4, start_step=0, logging_fn=lambda _: None)
    for _ in range(3):
        meter.start()
        time.sleep(0.005)
        meter.stop(global_step=True)
    return {"elapsed": elapsed, "mean": means["fwd"], "names": list(timers.get_timers()),
            "after_log": timers("fwd").elapsed(),
            "noop": [noop("x").elapsed(), noop.get_timers()],
            "throughput": [meter.global_step_count, 0 < meter.avg_samples_per_sec() < 4000],
            "names_c": [timer.FORWARD_GLOBAL_TIMER, timer.BACKWARD_REDUCE_GLOBAL_TIMER,
                        timer.STEP_MICRO_TIMER]}


@probe
def torch_utils():
    from deepspeed.utils.nvtx import instrument_w_nvtx
    from deepspeed.utils.torch import required_torch_version

    @instrument_w_nvtx
    def double(x):
        return 2 * x

    try:
        required_torch_version()
        raised = False
    except AssertionError:
        raised = True
    return [required_torch_version(min_version=2.0), required_torch_version(max_version=1.0),
            required_torch_version(min_version="2.4", max_version=99), raised, double(21),
            double.__name__]


@probe
def op_builder():
    import deepspeed.ops
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder
    loaded = CPUAdamBuilder().load()
    try:
        AsyncIOBuilder().load()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    ops = deepspeed.ops.__compatible_ops__
    return {"compatible": [CPUAdamBuilder().is_compatible(), FusedAdamBuilder().is_compatible(),
                           AsyncIOBuilder().is_compatible()],
            "loaded": loaded.DeepSpeedCPUAdam is DeepSpeedCPUAdam, "error": error,
            "ops": [ops["cpu_adam"], ops["fused_adam"], ops["cpu_adagrad"], ops["cpu_lion"],
                    ops["async_io"], ops["deepspeed_not_implemented"]]}


@probe
def zero3_engine():
    """One rank on gloo: ZeRO-3 parameters whole in unwrap_model_for_generation, the
    checkpoint's files, and DeepSpeed's grid."""
    import deepspeed
    import torch
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    from deepspeed.runtime.zero import unwrap_model_for_generation
    from deepspeed.utils.zero_to_fp32 import get_model_state_file, get_optim_files
    deepspeed.init_distributed("gloo")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    weight = engine.module[0].weight
    shapes = [list(weight.shape)]
    with unwrap_model_for_generation(engine) as unwrapped:
        shapes.append(list(weight.shape))
        same = unwrapped is engine
        with torch.no_grad():
            unwrapped(torch.ones(1, 8))  # a forward inside lets nothing go
        shapes.append(list(weight.shape))
    shapes.append(list(weight.shape))
    plain = torch.nn.Linear(2, 2)
    with unwrap_model_for_generation(plain) as got:
        same_plain = got is plain
    root = tempfile.mkdtemp()
    engine.save_checkpoint(root)
    tag = os.path.join(root, "global_step0")
    try:
        get_optim_files(os.path.join(root, "nowhere"))
        missing = None
    except FileNotFoundError as exc:
        missing = str(exc)
    grid = PipelineParallelGrid()
    return {"shapes": shapes, "same": [same, same_plain],
            "optim": [os.path.relpath(f, root) for f in get_optim_files(tag)],
            "optim_root": get_optim_files(root) == get_optim_files(tag),
            "model": os.path.relpath(get_model_state_file(tag, 3), root), "missing": missing,
            "grid": [grid.get_stage_id(), grid.get_data_parallel_world_size(),
                     grid.get_data_parallel_group_ranks(), grid.stage_to_global(0),
                     grid.is_first_stage, grid.is_last_stage]}


def _main() -> None:
    results = {}
    for name, fn in PROBES.items():
        try:
            results[name] = fn()
        except Exception as exc:  # reported, so one broken name fails one test
            results[name] = {"raised": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    _main()
else:
    import pytest

    from deepshard.contract import SHIM_DIR

    @pytest.fixture(scope="module")
    def got() -> dict[str, Any]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {"PYTHONPATH": SHIM_DIR, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0", "HOME": tempfile.gettempdir()}
        result = subprocess.run([sys.executable, str(Path(__file__).resolve())],
                                capture_output=True, text=True, timeout=180, env=env,
                                cwd=tempfile.gettempdir())
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_name_is_the_deepshard_object_the_table_names(got):
    assert got["resolution"] == dict.fromkeys(got["resolution"], True)
    assert len(got["resolution"]) == 20


def test_mics_init_is_one_explained_import_error(got):
    assert len(got["mics"]) == 2
    for line in got["mics"]:
        assert "MiCS" in line and "HINT: MiCS is the config's zero_optimization.mics_shard_" \
            "size" in line
        assert "\n" not in line


def test_on_device_builds_on_the_device_in_the_dtype_and_restores(got):
    assert got["on_device"] == ["meta", "torch.float16", "torch.int64", "torch.float32", "cpu",
                                "torch.float32"]


def test_config_model_forbids_extras_validates_assignment_and_drops_auto(got):
    c = got["config_utils"]
    assert c["auto"] == 3 and c["scalar"] == [1, 0]
    assert c["config"] == {"extra": "forbid", "validate_assignment": True,
                           "use_enum_values": True, "populate_by_name": True,
                           "validate_default": True, "arbitrary_types_allowed": True}
    assert len(c["errors"]) == 3 and "Duplicate keys in DeepSpeed config: ['a']" in c["errors"][2]
    assert "bogus" in c["errors"][0] and "size" in c["errors"][1]


def test_constants_are_deepspeeds_key_names(got):
    values = got["constants"]["values"]
    assert values["TRAIN_BATCH_SIZE"] == "train_batch_size"
    assert values["GRADIENT_CLIPPING_DEFAULT"] == 1.0 and values["STEPS_PER_PRINT_DEFAULT"] is None
    assert (values["BFLOAT16"], values["FP16"], values["DATA_TYPES"]) == ("bf16", "fp16",
                                                                           "data_types")
    assert values["CHECKPOINT_TAG_VALIDATION"] == "tag_validation"
    assert (values["ROUTE_TRAIN"], values["PIPE_REPLICATED"]) == ("train", "ds_pipe_replicated")
    assert got["constants"]["upper"] >= 137  # DeepSpeed 0.19.8's module has 137


def test_precision_configs_have_deepspeeds_fields_and_defaults(got):
    bf16, fp16, old_key, scale = got["precision"]
    assert bf16 == {"enabled": False, "immediate_grad_update": False,
                    "check_grad_overflow": True, "bf16_master_weights_and_grads": False,
                    "bf16_optimizer_states": False}
    assert fp16 == {"enabled": False, "auto_cast": False, "loss_scale": 0,
                    "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                    "consecutive_hysteresis": False, "min_loss_scale": 1,
                    "fp16_master_weights_and_grads": False}
    assert old_key is True and scale == 256


def test_zero_config_and_stage_enum(got):
    z = got["zero_config"]
    assert z["stages"] == {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3}
    assert z["max_stage"] and z["stage3"] and z["offload"] and z["same_enum"]
    assert z["engine_config"] and z["defaults"] == [500_000_000, 1_000_000_000]


def test_tiled_linear_is_a_grid_of_linears_equal_to_the_plain_one(got):
    t = got["tiled_linear"]
    assert t["grid"] == [[[3, 2, False], [3, 2, True]], [[3, 2, False], [3, 2, True]]]
    assert t["shape"] == [3, 4] and t["diff"] < 1e-6 and t["grads"]
    assert t["return_bias"][0] < 1e-6 and t["return_bias"][1] == [4]


def test_process_topology_answers_as_deepspeed_measured(got):
    measured = [6, 5, "ProcessCoord(pipe=1, data=1)", [[0, 1, 2], [3, 4, 5]], [0, 1, 2],
                [3, 4, 5], "", 0, ["pipe", "data"]]
    assert got["topology"]["process"] == measured
    assert got["topology"]["pipe_data"] == measured
    # DeepSpeed's docstring example: pipe x data x model of 2 x 2 x 2
    assert got["topology"]["pmd"] == [["pipe", "data", "model"],
                                      [[0, 4], [1, 5], [2, 6], [3, 7]], [2, 3], "model_01"]
    assert "filter_match" in got["topology"]["slice"]


def test_train_schedule_steps_as_deepspeed_measured(got):
    s = got["schedule"]
    assert s["train0"] == [
        ["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["SendActivation(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=1)", "ForwardPass(buffer_id=1)"],
        ["RecvGrad(buffer_id=0)", "SendActivation(buffer_id=1)", "BackwardPass(buffer_id=0)"],
        [],
        ["RecvGrad(buffer_id=1)", "BackwardPass(buffer_id=1)", "ReduceTiedGrads()",
         "ReduceGrads()", "OptimizerStep()"]]
    assert s["train1"] == [
        [], ["RecvActivation(buffer_id=0)", "LoadMicroBatch(buffer_id=0)",
             "ForwardPass(buffer_id=0)"],
        ["BackwardPass(buffer_id=0)"],
        ["SendGrad(buffer_id=0)", "RecvActivation(buffer_id=1)", "LoadMicroBatch(buffer_id=1)",
         "ForwardPass(buffer_id=1)"],
        ["BackwardPass(buffer_id=1)"],
        ["SendGrad(buffer_id=1)", "ReduceTiedGrads()", "ReduceGrads()", "OptimizerStep()"]]
    assert s["infer1"] == [
        [], ["LoadMicroBatch(buffer_id=0)", "RecvActivation(buffer_id=0)",
             "ForwardPass(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=1)", "RecvActivation(buffer_id=1)",
         "ForwardPass(buffer_id=1)"]]
    assert s["dp"][1][-2:] == ["ReduceGrads()", "OptimizerStep()"] and len(s["dp"]) == 2
    assert s["buffers"] == [2, 3] and all(s["bases"]) and s["attr"] == 3


def test_non_reentrant_checkpoint_gives_the_gradient_without_configure(got):
    assert got["non_reentrant"] < 1e-6


def test_comms_logger_starts_empty_and_records(got):
    assert got["comms_logger"] == [{}, [], True, False, False, False, False, True,
                                   ["all_reduce"], False]


def test_timers_measure_and_the_noop_one_does_not(got):
    t = got["timers"]
    assert 15 < t["elapsed"] < 2000 and 15 < t["mean"] < 2000 and t["names"] == ["fwd"]
    assert t["after_log"] == 0
    assert t["noop"] == [0, {}] and t["throughput"] == [3, True]
    assert t["names_c"] == ["fwd", "bwd_allreduce", "step_microstep"]


def test_torch_version_and_nvtx(got):
    assert got["torch_utils"] == [True, False, True, True, 42, "double"]


def test_op_builders_answer_for_deepshard(got):
    o = got["op_builder"]
    assert o["compatible"] == [True, True, False] and o["loaded"]
    assert o["error"].startswith("AsyncIOBuilder: deepshard has no async_io op") \
        and "HINT: NVMe offload" in o["error"]
    assert o["ops"] == [True, True, True, True, False, False]


def test_zero3_generation_checkpoint_files_and_grid(got):
    z = got["zero3_engine"]
    assert z["shapes"] == [[0], [8, 8], [8, 8], [0]] and z["same"] == [True, True]
    assert z["optim"] == ["global_step0/rank_00000.pt"] and z["optim_root"]
    assert z["model"] == "global_step0/model_states.pt"
    assert "directory doesn't exist" in z["missing"]
    assert z["grid"] == [0, 1, [0], 0, True, True]
