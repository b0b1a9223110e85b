"""The ecosystem's own DeepSpeed code paths on deepshard, scripts unchanged: transformers'
``Trainer`` with ``TrainingArguments(deepspeed=...)``, an Accelerate script with a
``DeepSpeedPlugin``, TRL's ``SFTTrainer`` and ``DPOTrainer``, started by ``ds-run
--deepspeed_compat`` (``import deepspeed`` is deepshard, and a ``deepspeed`` distribution
is seen) or by the ``deepspeed`` command of a ``ds-compat install``.

Each is compared with a plain-torch reference on the same batches (fp32, 1e-5) where one
is exact, and with what DeepSpeed 0.19.8 gave on the same script
(``tests/data/hf_native_deepspeed.json``, written by ``record_deepspeed.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_ds
from tests.integrations.test_hf_trainer import (
    DEEPSPEED_CHECKPOINT,
    DEEPSPEED_RESUME,
    UNIVERSAL_CASES,
    close,
    reference,
    universal_checkpoints,
)

SCRIPTS = ROOT / "tests" / "integrations" / "scripts"
DEEPSPEED = json.loads((ROOT / "tests" / "data" / "hf_native_deepspeed.json").read_text())
TRAINER = ("--backend", "deepspeed", "--micro", "2", "--gas", "2", "--steps", "6", "--lr",
           "1e-2", "--warmup", "2", "--clip", "0.5")


def compat(script: str, out: Path, *args: str, world: int = 2, timeout: float = 400
           ) -> None:
    result = run_ds("--deepspeed_compat", "--num_gpus", str(world), str(SCRIPTS / script),
                    *args, "--out_dir", str(out), timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def read(out: Path) -> dict:
    return json.loads((out / "rank0.json").read_text())


def within(got: list[float], want: list[float], rtol: float) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= rtol * abs(b)
                                         for a, b in zip(got, want, strict=True))


# ---- transformers' Trainer -------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected() -> dict:
    """test_hf_trainer's plain-torch reference of hf_trainer_train.py's training."""
    return reference()


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory) -> Path:
    """transformers' own Trainer (``--backend deepspeed``: the script imports nothing of
    deepshard) at ZeRO-2 and ZeRO-3 with an all-"auto" config; stage 3 also checkpoints,
    evaluates, saves and resumes; a LoRA adapter at stage 3; an evaluation-only run with
    the config's optimizer and scheduler sections (transformers' inference deepspeed_init);
    ``torch_compile=True`` at stages 0-3 (Accelerate calls ``engine.compile()``: inductor at
    stage 3, aot_eager, which traces the same graphs without generating code, below); the
    HF checkpoint DeepSpeed 0.19.8 wrote resumed, as it is and converted to universal."""
    out = tmp_path_factory.mktemp("hf_native_trainer")
    shutil.copytree(DEEPSPEED_CHECKPOINT / "checkpoint-2", out / "ds_checkpoint-2")
    universal_checkpoints(out)
    cases = ["s2 --stage 2",
             f"dsresumed {DEEPSPEED_RESUME} --resume {{out}}/ds_checkpoint-2",
             *UNIVERSAL_CASES,
             "s3 --stage 3 --save_steps 3 --evaluate --save_model",
             "s3resumed --stage 3 --resume {out}/s3/run/checkpoint-3",
             "lora --stage 3 --lora --save_steps 3 --save_model",
             "evalonly --stage 3 --eval_only --config_optim",
             *(f"c{k} --stage {k} --compile aot_eager" for k in (0, 1, 2)),
             "c3 --stage 3 --compile inductor"]
    compat("hf_trainer_train.py", out, *TRAINER, *[a for c in cases for a in ("--case", c)])
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_equals_plain_torch_and_deepspeed(trainer_job, expected, stage):
    got = read(trainer_job / f"s{stage}")
    assert close(got["losses"], expected["losses"]), (got["losses"], expected["losses"])
    assert close(got["grad_norms"], expected["grad_norms"])
    ds = DEEPSPEED[f"trainer-s{stage}"]
    assert close(got["losses"], ds["losses"]) and close(got["grad_norms"], ds["grad_norms"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainer_torch_compile_at_every_stage(trainer_job, expected, stage):
    got = read(trainer_job / f"c{stage}")
    assert got["compiled"]
    assert close(got["losses"], expected["losses"]), (got["losses"], expected["losses"])
    assert close(got["grad_norms"], expected["grad_norms"])


def test_trainer_resumes_deepspeeds_checkpoint(trainer_job):
    """transformers' own DeepSpeed path, on deepshard, resumes the ``checkpoint-2/`` that
    transformers + DeepSpeed 0.19.8 wrote: DeepSpeed's losses and grad norms follow."""
    theirs = json.loads((DEEPSPEED_CHECKPOINT / "deepspeed.json").read_text())
    resumed = read(trainer_job / "dsresumed")
    assert resumed["steps"] == [3, 4]
    assert close(resumed["losses"], theirs["losses"][2:]), (resumed, theirs)
    assert close(resumed["grad_norms"], theirs["grad_norms"][2:]), (resumed, theirs)


@pytest.mark.parametrize("case", ["universal", "universal3", "universalnoflag"])
def test_trainer_resumes_deepspeeds_checkpoint_converted_to_universal(trainer_job, case):
    """transformers' own ``deepspeed_load_checkpoint`` (it globs ``global_step*``) with
    ``"checkpoint": {"load_universal": true}``: ``checkpoint-2/global_step2_universal``
    resumes as ``global_step2`` does, beside it or alone at ZeRO-3 (where DeepSpeed 0.19.8
    fails: its stage 3 asserts on ``zero_pp_rank_*_model_states.pt``, which a universal
    folder converted from ZeRO-2 does not hold); and alone without the key (DeepSpeed
    0.19.8 + transformers: ``failed to resume from checkpoint``)."""
    plain, resumed = read(trainer_job / "dsresumed"), read(trainer_job / case)
    assert resumed["steps"] == [3, 4]
    assert close(resumed["losses"], plain["losses"]), (resumed, plain)
    assert close(resumed["grad_norms"], plain["grad_norms"]), (resumed, plain)


def test_trainer_checkpoints_resume_and_save_in_hf_format(trainer_job):
    whole, resumed = read(trainer_job / "s3"), read(trainer_job / "s3resumed")
    assert resumed["steps"] == [4, 5, 6]
    assert close(resumed["losses"], whole["losses"][3:])
    ckpt = trainer_job / "s3" / "run" / "checkpoint-3"
    assert (ckpt / "global_step3").is_dir() and (ckpt / "trainer_state.json").is_file()
    assert (trainer_job / "s3" / "saved" / "config.json").is_file()
    lora = trainer_job / "lora"
    assert (lora / "saved" / "adapter_model.safetensors").is_file()
    assert len(read(lora)["losses"]) == 6


def test_trainer_evaluation_only_builds_no_scheduler(trainer_job, expected):
    """transformers drops the optimizer but keeps a scheduler filled with 0 steps: DeepSpeed
    builds no scheduler without an optimizer, and neither does deepshard. The eval set is
    the first global batch: its loss is step 1's."""
    got = read(trainer_job / "evalonly")
    assert got["losses"] == []
    assert got["eval_loss_before"] == pytest.approx(expected["losses"][0], rel=1e-5)


def test_zero3_loads_sharded_resizes_trains_and_generates(tmp_path):
    """transformers sees ZeRO-3 (``is_deepspeed_zero3_enabled``): ``from_pretrained`` loads
    into shards through deepshard's sliced reader (each rank reads about half of the
    checkpoint's tensor bytes), ``resize_token_embeddings`` gathers and grows the embedding, and
    ``generate(synced_gpus=True)`` keeps the ranks in step while they decode prompts of
    different lengths; losses and tokens equal the same script without DeepSpeed."""
    compat("hf_z3_model_ops.py", tmp_path / "z3")
    # one process, no process group: none of the launch variables an earlier test of this
    # run may have left in the environment
    alone = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT") and not k.startswith("ACCELERATE_")}
    plain = subprocess.run([sys.executable, str(SCRIPTS / "hf_z3_model_ops.py"), "--plain",
                            "--out_dir", str(tmp_path / "plain")], capture_output=True,
                           text=True, timeout=300, cwd=ROOT, env=alone)
    assert plain.returncode == 0, plain.stderr[-3000:]
    want = json.loads((tmp_path / "plain" / "rank0.json").read_text())
    for rank in (0, 1):
        got = json.loads((tmp_path / "z3" / f"rank{rank}.json").read_text())
        assert got["zero3"] and got["partitioned"] and got["vocab"] == want["vocab"] == 136
        assert 0 < got["bytes_read"] < 0.6 * got["checkpoint_bytes"], got
        assert close(got["losses"], want["losses"]), (got, want)
        assert got["generated"][str(rank)] == want["generated"][str(rank)]


# ---- Accelerate ------------------------------------------------------------------------------


def accelerate_reference(steps: int = 4) -> dict:
    """accelerate_train.py's training in one process: AdamW (lr 1e-2, weight decay 0.01),
    global batches of 8 (2 ranks x 2 micro-batches of 2), clipping at 0.5."""
    import torch
    import transformers

    from tests.integrations.scripts.hf_trainer_train import dataset
    from tests.integrations.tiny import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = dataset(8 * steps)
    losses, norms = [], []
    for step in range(steps):
        ids = torch.stack([b["input_ids"] for b in data[8 * step:8 * step + 8]])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


@pytest.fixture(scope="module")
def accelerate_expected() -> dict:
    return accelerate_reference()


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_deepspeed_plugin(tmp_path, accelerate_expected, stage):
    """At stage 3 the plugin's ``zero3_init_flag`` (on by default) builds the model, created
    after the ``Accelerator``, under ``zero.Init``, whose per-module initialisation draws
    the random weights in another order than a plain build: deepshard's draws DeepSpeed's
    weights (equal to 1e-5 to DeepSpeed 0.19.8's run), not the reference's."""
    compat("accelerate_train.py", tmp_path, "--stage", str(stage))
    got = read(tmp_path)
    assert got["deepspeed"] and got["engine"] == "deepshard.runtime.engine.DeepShardEngine"
    if stage == 2:
        assert close(got["losses"], accelerate_expected["losses"]), (got, accelerate_expected)
        assert close(got["grad_norms"], accelerate_expected["grad_norms"])
    ds = DEEPSPEED[f"accelerate-s{stage}"]
    assert close(got["losses"], ds["losses"]) and close(got["grad_norms"], ds["grad_norms"])


# ---- TRL -------------------------------------------------------------------------------------

# TRL's losses go through its fused LM head, whose DeepSpeed and DDP paths differ in
# transformers/TRL themselves: at world 1, before any update, the DeepSpeed path's
# gradient norm is 1.8e-4 (relative) from the DDP path's, with DeepSpeed 0.19.8 as with
# deepshard. So TRL's runs are held to DeepSpeed 0.19.8 on the same script (measured: step
# 1 within 1e-4, later steps within 1e-3 after Adam at lr 1e-2 amplifies it), and to each
# other across stages, exactly.
TRL_RTOL_FIRST, TRL_RTOL = 1e-4, 1e-3


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory) -> dict[int, dict]:
    runs = {}
    for stage in (2, 3):
        out = tmp_path_factory.mktemp(f"sft{stage}")
        compat("trl_train.py", out, "--trainer", "sft", "--stage", str(stage))
        runs[stage] = read(out)
    return runs


def test_trl_sft_is_the_same_at_stages_2_and_3(sft_runs):
    assert within(sft_runs[3]["losses"], sft_runs[2]["losses"], 1e-6)
    assert within(sft_runs[3]["grad_norms"], sft_runs[2]["grad_norms"], 1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_trl_sft_matches_deepspeed(sft_runs, stage):
    got, ds = sft_runs[stage], DEEPSPEED[f"sft-s{stage}"]
    assert within(got["losses"][:1] + got["grad_norms"][:1],
                  ds["losses"][:1] + ds["grad_norms"][:1], TRL_RTOL_FIRST), (got, ds)
    assert within(got["losses"], ds["losses"], TRL_RTOL), (got, ds)


def test_trl_dpo_at_stage_3_matches_deepspeed(tmp_path):
    """The reference model goes through ``deepspeed.initialize`` too (TRL's
    ``prepare_deepspeed``, with its dotted ``zero_optimization.*`` keys)."""
    compat("trl_train.py", tmp_path, "--trainer", "dpo", "--stage", "3")
    got, ds = read(tmp_path), DEEPSPEED["dpo-s3"]
    assert within(got["losses"][:1], ds["losses"][:1], TRL_RTOL_FIRST), (got, ds)
    assert within(got["losses"], ds["losses"], TRL_RTOL), (got, ds)


# ---- ds-compat install: the `deepspeed` command and accelerate launch --------------------------


@pytest.fixture(scope="module")
def environment(tmp_path_factory) -> dict:
    """``ds-compat install`` into a scratch ``site-packages`` and scripts directory (not
    this test run's environment): what it writes, and an environment that sees it."""
    from deepshard.compat import environment as env

    root = tmp_path_factory.mktemp("compat_env")
    target = env.Target(root / "site", root / "bin")
    written = env.install(target)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT") and not k.startswith("ACCELERATE_")}
    environ = dict(clean, PYTHONPATH=os.pathsep.join(
        [str(target.purelib), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        PATH=os.pathsep.join([str(target.scripts), os.environ.get("PATH", "")]))
    yield {"target": target, "written": written, "env": environ}
    env.uninstall(target)


def test_the_installed_distribution_is_deepshard(environment):
    code = ("import importlib.metadata, deepspeed, deepshard; "
            "print(deepspeed is deepshard, importlib.metadata.version('deepspeed'), "
            "deepspeed.__version__)")
    out = subprocess.run([sys.executable, "-c", code], env=environment["env"], text=True,
                         capture_output=True, timeout=120, cwd=environment["target"].purelib)
    assert out.returncode == 0, out.stderr
    from deepshard.compat import distribution

    assert out.stdout.split() == ["True", distribution.version(), distribution.version()]


def test_the_deepspeed_command_runs_an_unchanged_trainer_script(environment, tmp_path,
                                                                  expected):
    """``deepspeed --num_gpus 2 train.py --deepspeed ds.json``-style, as DeepSpeed's docs
    write it: the ``deepspeed`` the install wrote is ds-run --deepspeed_compat."""
    command = Path(environment["target"].scripts) / "deepspeed"
    result = subprocess.run([str(command), "--num_gpus", "2",
                             str(SCRIPTS / "hf_trainer_train.py"), *TRAINER, "--stage", "2",
                             "--out_dir", str(tmp_path)], env=environment["env"], text=True,
                            capture_output=True, timeout=400, cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = read(tmp_path)
    assert close(got["losses"], expected["losses"]), (got, expected)


def test_accelerate_launch_with_a_config_file(environment, tmp_path):
    """``accelerate launch --config_file`` with a DeepSpeed section (ZeRO-3): Accelerate
    checks for DeepSpeed in its own process and starts the workers itself; the script
    builds no plugin (``--plugin none``). The same training as the stage-3 plugin run."""
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        "deepspeed_config:\n  zero_stage: 3\n  gradient_accumulation_steps: 2\n"
        "  gradient_clipping: 0.5\n  zero3_init_flag: true\n"
        "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nmain_training_function: main\n"
        "mixed_precision: 'no'\nuse_cpu: false\n")
    accelerate = Path(sys.executable).with_name("accelerate")
    result = subprocess.run([str(accelerate), "launch", "--config_file", str(config),
                             str(SCRIPTS / "accelerate_train.py"), "--plugin", "none",
                             "--out_dir", str(tmp_path / "out")], env=environment["env"],
                            text=True, capture_output=True, timeout=400, cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = read(tmp_path / "out")
    assert got["deepspeed"] and got["world"] == 2
    assert close(got["losses"], DEEPSPEED["accelerate-s3"]["losses"]), got
