"""deepshard's HF ``Trainer``/``TrainingArguments`` at ZeRO stages 0-3 on 2 gloo ranks:
per-step losses and gradient norms equal a plain-torch single-process reference of the
same training (same weights, data order, AdamW, clipping, linear warmup schedule, the loss
averaged over the global batch), with gradient accumulation 2; ``save_strategy="steps"``
checkpoints and ``resume_from_checkpoint`` (at world 2 and at world 1) continue with the
losses of the uninterrupted run; ``save_model`` writes the HF format.

One job runs every world-2 training one after another (``--case``): process start-up and
imports are most of a run's time on 2 cores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_ds

SCRIPT = ROOT / "tests" / "integrations" / "scripts" / "hf_trainer_train.py"
TRAINING = dict(micro=2, gas=2, world=2, steps=6, lr=1e-2, warmup=2, clip=0.5,
                weight_decay=0.01)
COMMON = ("--micro", "2", "--gas", "2", "--steps", "6", "--lr", "1e-2", "--warmup", "2",
          "--clip", "0.5")
RTOL = 1e-5
DEEPSPEED_CHECKPOINT = ROOT / "tests" / "data" / "deepspeed_checkpoints" / "hf_trainer_zero2"
DEEPSPEED_RESUME = "--stage 2 --gas 1 --steps 4 --warmup 1"
"""The training that wrote the fixture (after COMMON: the script's defaults otherwise)."""


UNIVERSAL_CASES = (
    f"universal {DEEPSPEED_RESUME} --universal --resume {{out}}/universal-2",
    "universal3 --stage 3 --gas 1 --steps 4 --warmup 1 --universal "
    "--resume {out}/universalonly-2",
    f"universalnoflag {DEEPSPEED_RESUME} --resume {{out}}/universalonly-2")
"""Resumes of :func:`universal_checkpoints` that both HF paths run: with ``"checkpoint":
{"load_universal": true}`` the layout DeepSpeed's docs describe at the stage it was saved
at, and the universal folder alone at ZeRO-3; without the key, the universal folder
alone (the engine's load takes it: there is nothing else to resume)."""


def universal_checkpoints(out: Path) -> None:
    """The fixture's ``checkpoint-2`` after its user converted ``global_step2`` (``python -m
    deepshard.runtime.checkpoint.universal``, DeepSpeed's ``ds_to_universal`` flags) into
    ``global_step2_universal`` beside it: ``out/universal-2``; and with ``global_step2`` and
    ``latest`` then deleted, the universal folder alone: ``out/universalonly-2``."""
    from deepshard.runtime.checkpoint import universal

    both, only = out / "universal-2", out / "universalonly-2"
    shutil.copytree(DEEPSPEED_CHECKPOINT / "checkpoint-2", both)
    universal.convert(both / "global_step2", both / "global_step2_universal")
    shutil.copytree(both, only)
    shutil.rmtree(only / "global_step2")
    (only / "latest").unlink()


def run_script(out: Path, *cases: str, world: int = 2, extra: tuple[str, ...] = ()) -> None:
    args = [a for case in cases for a in ("--case", case)]
    result = run_ds("--num_gpus", str(world), str(SCRIPT), *COMMON, *extra,
                    "--out_dir", str(out), *args, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def read(out: Path, case: str) -> dict:
    return json.loads((out / case / "rank0.json").read_text())


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """Stages 0-3 (stage 3 with checkpoints every 3 steps, evaluation and an HF save),
    stage 3 resumed from its checkpoint-3, stage 3 with ``evaluate()`` before ``train()``, a
    LoRA adapter at stage 3 (checkpoints without the frozen base) and its resume, stage 2
    with ``load_best_model_at_end``; and the HF Trainer checkpoint DeepSpeed 0.19.8 wrote
    (``tests/data/deepspeed_checkpoints/hf_trainer_zero2``) resumed, as it is and converted
    to universal (:func:`universal_checkpoints`): with ``load_universal``, at ZeRO-3,
    without the key when the universal folder is the only one, and named itself."""
    out = tmp_path_factory.mktemp("hf_trainer")
    shutil.copytree(DEEPSPEED_CHECKPOINT / "checkpoint-2", out / "ds_checkpoint-2")
    universal_checkpoints(out)
    run_script(out, "s0 --stage 0", "s1 --stage 1", "s2 --stage 2",
               f"dsresumed {DEEPSPEED_RESUME} --resume {{out}}/ds_checkpoint-2",
               *UNIVERSAL_CASES,
               f"universaltag {DEEPSPEED_RESUME} "
               "--resume {out}/universalonly-2/global_step2_universal",
               "s3 --stage 3 --save_steps 3 --evaluate --save_model",
               "s3resumed --stage 3 --resume {out}/s3/run/checkpoint-3",
               "s3evalfirst --stage 3 --eval_first",
               "s3twice --stage 3 --twice",
               "lora --stage 3 --lora --save_steps 3 --save_model",
               "loraresumed --stage 3 --lora --resume {out}/lora/run/checkpoint-3",
               "best --stage 2 --best --save_steps 2 --evaluate")
    return out


def reference() -> dict:
    """The same training in one process with plain torch."""
    import tempfile

    import torch
    import transformers

    from tests.integrations.scripts.hf_trainer_train import dataset
    from tests.integrations.tiny import save_tiny

    t = TRAINING
    with tempfile.TemporaryDirectory() as tmp:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            save_tiny("llama", Path(tmp) / "m", seed=0))
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in named if n in decay], "weight_decay": t["weight_decay"]},
         {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}],
        lr=t["lr"], betas=(0.9, 0.999), eps=1e-8)
    sched = transformers.get_linear_schedule_with_warmup(opt, t["warmup"], t["steps"])
    per_step = t["micro"] * t["gas"] * t["world"]
    data = dataset(per_step * t["steps"])
    losses, norms = [], []
    for step in range(t["steps"]):
        batch = data[step * per_step:(step + 1) * per_step]
        ids = torch.stack([b["input_ids"] for b in batch])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t["clip"])))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms}


@pytest.fixture(scope="module")
def expected() -> dict:
    return reference()


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= RTOL * abs(b)
                                         for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_losses_match_plain_torch(job, expected, stage):
    got = read(job, f"s{stage}")
    assert got["steps"] == [1, 2, 3, 4, 5, 6]
    assert close(got["losses"], expected["losses"]), (got["losses"], expected["losses"])
    assert close(got["grad_norms"], expected["grad_norms"]), (got["grad_norms"],
                                                              expected["grad_norms"])
    assert got["lrs"] == pytest.approx([0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025])


def test_evaluate_before_train(job, expected):
    """The eval set's samples are the first global batch's: its loss is step 1's."""
    got = read(job, "s3evalfirst")
    assert got["eval_loss_before"] == pytest.approx(expected["losses"][0], rel=RTOL)
    assert close(got["losses"], expected["losses"]), (got["losses"], expected["losses"])


def test_a_second_train_at_stage_3_goes_on_from_the_trained_weights(job, expected):
    """A new engine over the module the first one left partitioned: the first run is the
    uninterrupted one, the second starts its schedule again from the trained weights."""
    got = read(job, "s3twice")
    first, second = got["losses"][:6], got["losses"][6:]
    assert close(first, expected["losses"]), (first, expected["losses"])
    assert len(second) == 6 and second[0] < first[0]
    assert got["lrs"][6:] == pytest.approx(got["lrs"][:6])


def test_checkpoints_hold_the_engine_checkpoint_and_trainer_state(job):
    for step in (3, 6):
        ckpt = job / "s3" / "run" / f"checkpoint-{step}"
        assert (ckpt / f"global_step{step}").is_dir()
        assert (ckpt / "latest").read_text().strip() == f"global_step{step}"
        state = json.loads((ckpt / "trainer_state.json").read_text())
        assert state["global_step"] == step
        assert (ckpt / "scheduler.pt").is_file()  # the Trainer's own scheduler


def test_resume_continues_as_the_uninterrupted_run(job):
    whole, resumed = read(job, "s3"), read(job, "s3resumed")
    assert resumed["steps"] == [4, 5, 6]
    assert close(resumed["losses"], whole["losses"][3:]), (resumed, whole)


def test_resume_from_deepspeeds_checkpoint_continues_as_deepspeed_did(job):
    """A ``checkpoint-2/`` folder transformers + DeepSpeed 0.19.8 wrote (ZeRO-2, 2 ranks)
    resumes under deepshard: steps 3-4 log DeepSpeed's own losses and grad norms."""
    theirs = json.loads((DEEPSPEED_CHECKPOINT / "deepspeed.json").read_text())
    resumed = read(job, "dsresumed")
    assert resumed["steps"] == [3, 4]
    assert close(resumed["losses"], theirs["losses"][2:]), (resumed, theirs)
    assert close(resumed["grad_norms"], theirs["grad_norms"][2:]), (resumed, theirs)
    assert resumed["lrs"] == pytest.approx(theirs["lrs"][2:], rel=1e-9)


@pytest.mark.parametrize("case", ["universal", "universal3", "universalnoflag",
                                  "universaltag"])
def test_resume_from_a_universal_checkpoint_continues_as_the_plain_resume(job, case):
    """DeepSpeed's checkpoint converted to universal resumes as the checkpoint itself does
    (``dsresumed``): with ``load_universal`` (beside ``global_step2``, or alone at ZeRO-3,
    where DeepSpeed 0.19.8's universal load fails), without it when the universal folder is
    the only one, and given as ``resume_from_checkpoint=checkpoint-2/global_step2_universal``
    (transformers would look for ``trainer_state.json`` in it)."""
    plain, resumed = read(job, "dsresumed"), read(job, case)
    assert resumed["steps"] == [3, 4]
    assert close(resumed["losses"], plain["losses"]), (resumed, plain)
    assert close(resumed["grad_norms"], plain["grad_norms"]), (resumed, plain)
    assert resumed["lrs"] == pytest.approx(plain["lrs"], rel=1e-9)


def test_what_resume_from_checkpoint_resumes(tmp_path):
    """The Trainer's state from the folder, the engine's from the tag it names or holds
    alone; a folder without the Trainer's state is one line (transformers raises
    ``FileNotFoundError`` for ``trainer_state.json``)."""
    from deepshard.errors import UsageError, render
    from deepshard.integrations import hf_resume

    universal_checkpoints(tmp_path)
    both, only = str(tmp_path / "universal-2"), str(tmp_path / "universalonly-2")
    assert hf_resume.checkpoint_folder(only) == (only, None)
    for tag in ("global_step2", "global_step2_universal"):
        assert hf_resume.checkpoint_folder(f"{both}/{tag}") == (both, tag)
    for path in (tmp_path / "universal-2" / "global_step2_universal" / "zero", tmp_path):
        with pytest.raises(UsageError) as info:
            hf_resume.checkpoint_folder(str(path))
        line = render(info.value)
        assert "\n" not in line and "no trainer_state.json" in line and "HINT" in line


@pytest.fixture(scope="module")
def world1(job) -> Path:
    """Resumes at world 1 (micro-batch 4: the same global batches; the engine reshards):
    the stage-3 run's checkpoint-3, and DeepSpeed's world-2 ZeRO-2 checkpoint converted to
    universal at ZeRO-3."""
    run_script(job / "w1", f"r --stage 3 --micro 4 --resume {job}/s3/run/checkpoint-3",
               f"universal --stage 3 --micro 4 --gas 1 --steps 4 --warmup 1 --universal "
               f"--resume {job}/universalonly-2", world=1)
    return job / "w1"


def test_resume_at_world_1_from_a_universal_checkpoint(job, world1):
    plain, resumed = read(job, "dsresumed"), read(world1, "universal")
    assert resumed["steps"] == [3, 4]
    assert close(resumed["losses"], plain["losses"]), (resumed, plain)
    assert close(resumed["grad_norms"], plain["grad_norms"]), (resumed, plain)


def test_resume_at_world_1_from_a_world_2_checkpoint(job, world1):
    """Micro-batch 4 on one rank: the same global batches; the engine reshards."""
    resumed, whole = read(world1, "r"), read(job, "s3")
    assert resumed["steps"] == [4, 5, 6]
    assert close(resumed["losses"], whole["losses"][3:]), (resumed, whole)


def test_evaluate_and_save_model_in_hf_format(job, expected):
    import torch
    import transformers

    from tests.integrations.scripts.hf_trainer_train import dataset

    got = read(job, "s3")
    saved = transformers.AutoModelForCausalLM.from_pretrained(job / "s3" / "saved")
    ids = torch.stack([b["input_ids"] for b in dataset(8)])
    with torch.no_grad():
        loss = saved(input_ids=ids, labels=ids).loss.item()
    assert loss == pytest.approx(got["eval_loss"], rel=1e-5)


def test_lora_checkpoints_resume_and_save_the_adapter(job):
    whole, resumed = read(job, "lora"), read(job, "loraresumed")
    assert resumed["steps"] == [4, 5, 6]
    assert close(resumed["losses"], whole["losses"][3:]), (resumed, whole)
    assert (job / "lora" / "saved" / "adapter_model.safetensors").is_file()
    assert (job / "lora" / "run" / "checkpoint-3" / "global_step3").is_dir()


def test_load_best_model_at_end(job):
    state = json.loads((job / "best" / "run" / "checkpoint-6" / "trainer_state.json")
                       .read_text())
    evals = [x["eval_loss"] for x in state["log_history"] if "eval_loss" in x]
    assert state["best_model_checkpoint"].endswith("checkpoint-4")
    assert read(job, "best")["eval_loss"] == pytest.approx(min(evals), rel=RTOL)


def test_training_arguments_keep_the_config_alive(tmp_path):
    from deepshard.integrations import hf_loading
    from deepshard.integrations.hf_auto import HfTrainerDeepShardConfig
    from deepshard.integrations.hf_trainer import TrainingArguments

    given = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3,
                             deepspeed=given, report_to="none", use_cpu=True)
    assert args.deepspeed is given and given["train_micro_batch_size_per_gpu"] == "auto"
    assert isinstance(args.hf_deepspeed_config, HfTrainerDeepShardConfig)
    assert args.hf_deepspeed_config.config["train_micro_batch_size_per_gpu"] == 3
    assert hf_loading.active_config() is args.hf_deepspeed_config
    assert args.place_model_on_device is False
    del args


def test_hf_argument_parser_takes_a_config_file(tmp_path):
    """``--deepspeed ds_config.json`` on a script's command line, as with DeepSpeed."""
    import transformers

    from deepshard.integrations.hf_trainer import TrainingArguments

    path = tmp_path / "ds_config.json"
    path.write_text('{"gradient_accumulation_steps": "auto", // comments as DeepSpeed reads\n'
                    ' "zero_optimization": {"stage": 2}}')
    (args,) = transformers.HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--deepspeed", str(path), "--use_cpu",
         "--gradient_accumulation_steps", "4", "--report_to", "none"])
    assert isinstance(args, TrainingArguments) and args.deepspeed == str(path)
    assert args.hf_deepspeed_config.config["gradient_accumulation_steps"] == 4


def test_a_mismatch_stops_train_with_one_line(tmp_path):
    """Raised where transformers raises it (the engine's build in ``train()``), before any
    process group: in this process."""
    import transformers

    from deepshard.errors import UsageError, render
    from deepshard.integrations.hf_trainer import Trainer, TrainingArguments
    from tests.integrations.scripts.hf_trainer_train import dataset
    from tests.integrations.tiny import tiny_config

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             max_steps=1, report_to="none", use_cpu=True,
                             deepspeed={"train_micro_batch_size_per_gpu": 4,
                                        "zero_optimization": {"stage": 2}})
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    trainer = Trainer(model=model, args=args, train_dataset=dataset(4))
    with pytest.raises(UsageError) as info:
        trainer.train()
    line = render(info.value)
    assert "\n" not in line and "HINT" in line
    assert "train_micro_batch_size_per_gpu=4 but TrainingArguments " \
           "per_device_train_batch_size=2" in line
