"""One rank of ``benchmarks/hf.py``: runs under deepshard's interpreter or DeepSpeed's.

It imports only torch, transformers (and peft) and the library it measures, never the other
one, and reports one ``BENCH_RESULT {json}`` line on stdout; ``hf.py`` starts two of these
per row with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (no launcher). ``--driver compat``
is DeepSpeed's code path (transformers' own Trainer) under deepshard's interpreter with the
compat shim first on ``PYTHONPATH``, so that ``import deepspeed`` is deepshard; the worker
checks that it is.

    python hf_worker.py make-model DIR [--quick]
    python hf_worker.py train {deepspeed,deepshard} --driver {trainer,compat,initialize} ...
    python hf_worker.py load {deepspeed,deepshard} --model DIR
    python hf_worker.py lora {deepspeed,deepshard} --model DIR ...
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
import traceback

RESULT_TAG = "BENCH_RESULT "
SEED = 0
SEQ = 128
MODEL_SIZES = {
    # ~134M parameters (untied 32000 x 768 embedding and head: 2 x 24.6M; 12 blocks x 7.1M)
    "full": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 2048,
             "num_attention_heads": 12, "num_key_value_heads": 12},
    # ~28M parameters, for a quick look
    "quick": {"hidden_size": 384, "num_hidden_layers": 2, "intermediate_size": 1024,
              "num_attention_heads": 6, "num_key_value_heads": 6},
}
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-4, 0.01, 1.0
"""What TrainingArguments gets and what the "auto" values become for ``initialize``."""


def hf_config(stage: int) -> dict:
    """The HF-style config every peer gets: everything "auto" but the ZeRO stage (the
    Trainer fills the "auto" values from its TrainingArguments)."""
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update({"stage3_gather_16bit_weights_on_model_save": "auto",
                     "stage3_prefetch_bucket_size": "auto",
                     "stage3_param_persistence_threshold": "auto",
                     "reduce_bucket_size": "auto"})
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                      "eps": "auto",
                                                      "weight_decay": "auto"}},
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "zero_optimization": zero}


def filled_config(stage: int, micro_batch: int, world: int, hidden: int) -> dict:
    """:func:`hf_config` with the "auto" values filled as transformers' Trainer fills
    them (TrainingArguments defaults, lr/weight decay as given here), for ``initialize``."""
    zero: dict = {"stage": stage}
    if stage == 3:  # transformers' fill for the model's hidden size
        zero.update({"reduce_bucket_size": hidden * hidden,
                     "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                     "stage3_param_persistence_threshold": 10 * hidden})
    return {"train_micro_batch_size_per_gpu": micro_batch,
            "train_batch_size": micro_batch * world, "gradient_accumulation_steps": 1,
            "gradient_clipping": MAX_GRAD_NORM,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999],
                                                      "eps": 1e-8,
                                                      "weight_decay": WEIGHT_DECAY}},
            "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "zero_optimization": zero}


def plain_config(a: argparse.Namespace, stage: int) -> dict:
    """:func:`filled_config` for the model in ``a.model``: what a script outside the Trainer
    gives ``HfDeepSpeedConfig``/``HfDeepShardConfig`` and ``initialize`` (no "auto")."""
    with open(os.path.join(a.model, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    return filled_config(stage, a.micro_batch, int(os.environ["WORLD_SIZE"]), hidden)


def since_process_start() -> float:
    """Seconds since the kernel created this process (``/proc/self/stat``'s start time, in
    clock ticks since boot, against ``CLOCK_BOOTTIME``; 10 ms resolution): the interpreter's
    start and every import count."""
    with open("/proc/self/stat") as f:  # the name field may hold spaces: split after it
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


WORKER_START_S = since_process_start()
"""When this module began running: the interpreter's own start-up (and site's imports)."""


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def current_rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def emit(result: dict) -> None:
    print(RESULT_TAG + json.dumps(result), flush=True)


def library(lib: str, driver: str = ""):
    """The measured library's module: ``deepspeed`` (for ``compat``, deepshard behind the
    shim: anything else there is an error) or ``deepshard``."""
    if lib == "deepspeed" or driver == "compat":
        import deepspeed
        if driver == "compat" and not deepspeed.__name__.startswith("deepshard"):
            raise RuntimeError(f"import deepspeed gave {deepspeed.__file__}, not deepshard: "
                               "is the compat shim first on PYTHONPATH?")
        return deepspeed
    import deepshard
    return deepshard


def hf_config_class(lib: str):
    """HfDeepSpeedConfig (transformers) or HfDeepShardConfig (deepshard)."""
    if lib == "deepspeed":
        from transformers.integrations import HfDeepSpeedConfig
        return HfDeepSpeedConfig
    from deepshard.integrations.hf_config import HfDeepShardConfig
    return HfDeepShardConfig


def local_param_bytes(module) -> dict[str, int]:
    """Bytes of parameter storage this rank holds for ``module``: a partitioned parameter
    (DeepSpeed's ``ds_tensor``, deepshard's ``ds_shard``) counts its shard, unless it is
    gathered (its ``data`` is whole again); any other parameter its ``data``."""
    held = full = 0
    for p in module.parameters():
        numel = getattr(p, "ds_numel", None) or p.numel()
        full += numel * p.element_size()
        shard = getattr(p, "ds_tensor", None)
        if shard is None:
            shard = getattr(p, "ds_shard", None)
        if shard is not None and p.data.numel() < numel:
            held += shard.numel() * shard.element_size() + p.data.numel() * p.element_size()
        else:
            held += p.data.numel() * p.element_size()
    return {"held": held, "full": full}


class CommCounter:
    """Bytes through torch.distributed's collectives (both libraries call them through the
    module's attributes on CPU): all-gather output, reduce-scatter input, all-reduce; from
    :meth:`reset` on. Counting only: every call goes through unchanged."""

    NAMES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")

    def __init__(self):
        import torch.distributed as dist

        self.bytes = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, call):
        which, key = (1, "input") if name == "reduce_scatter_tensor" else (0, "tensor")

        def counted(*args, **kwargs):
            tensor = args[which] if len(args) > which else kwargs.get(
                key, kwargs.get("output_tensor"))
            if hasattr(tensor, "numel"):
                self.bytes[name] += tensor.numel() * tensor.element_size()
            return call(*args, **kwargs)
        return counted

    def reset(self) -> None:
        self.bytes = dict.fromkeys(self.NAMES, 0)

    def per_step(self, steps: int) -> dict[str, float]:
        return {name: count / max(1, steps) for name, count in self.bytes.items()}


def batches(n: int, micro_batch: int, vocab: int):
    """``n`` seeded random token batches (the same on every rank and library)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab, (n, micro_batch, SEQ), generator=gen)


# ---------------------------------------------------------------- make-model

def make_model(path: str, size: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, max_position_embeddings=2 * SEQ,
                         tie_word_embeddings=False, **MODEL_SIZES[size])
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    emit({"params": sum(p.numel() for p in model.parameters()),
          "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
          "hidden": config.hidden_size, "vocab": config.vocab_size})


# ---------------------------------------------------------------- train

def train(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    lib = library(a.lib, a.driver)
    notes: list[str] = []
    if a.driver == "compat":
        notes.append(f"import deepspeed -> {lib.__name__} {lib.__version__}")
    result = (_train_initialize(a, lib, notes) if a.driver == "initialize"
              else _train_trainer(a, notes))
    result.update({"peak_rss_kib": peak_rss_kib(), "notes": notes,
                   "worker_start_s": WORKER_START_S,
                   "version": getattr(lib, "__version__", "?")})
    emit(result)


def _train_trainer(a: argparse.Namespace, notes: list[str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    comm = CommCounter()
    if a.lib == "deepspeed" or a.driver == "compat":
        from transformers import Trainer, TrainingArguments
    else:
        try:
            from deepshard.integrations.transformers import Trainer, TrainingArguments
        except ImportError:  # the module that re-exports them may not be there yet
            from deepshard.integrations.hf_trainer import Trainer, TrainingArguments
            notes.append("Trainer from deepshard.integrations.hf_trainer")

    steps = a.warmup + a.steps
    world = int(os.environ["WORLD_SIZE"])
    data = batches(steps * world, a.micro_batch, a.vocab).flatten(0, 1)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.losses: list[float] = []
            self.start = self.first_step_s = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if len(self.times) == a.warmup:
                comm.reset()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)
            if len(self.times) == 1:  # after the optimizer step (the engine's, in backward)
                self.first_step_s = since_process_start()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    out = tempfile.mkdtemp(prefix="hf-bench-out-")
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=a.micro_batch,
                             max_steps=steps, learning_rate=LR, weight_decay=WEIGHT_DECAY,
                             max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="constant",
                             logging_steps=1, save_strategy="no", report_to=[],
                             disable_tqdm=True, seed=SEED, dataloader_num_workers=0,
                             use_cpu=True, deepspeed=hf_config(a.stage))
    if a.lib == "deepspeed":
        # on CPU, accelerate (use_cpu) starts torch.distributed (gloo) but not
        # deepspeed.comm, and zero.Init would then count one rank (batch-size assertion at
        # ZeRO-3; at ZeRO-2 deepspeed.initialize starts it). deepshard's comm (compat) uses
        # the group accelerate started: no call there.
        import deepspeed

        deepspeed.init_distributed()
        notes.append("deepspeed.init_distributed() after TrainingArguments (CPU)")
    # after TrainingArguments, as transformers documents: at ZeRO-3 the model is built
    # partitioned through the config the arguments hold
    before = peak_rss_kib()
    model = AutoModelForCausalLM.from_pretrained(a.model)
    load = {"load_peak_kib": peak_rss_kib(), "before_load_kib": before,
            "loaded_params": local_param_bytes(model)}
    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[clock])
    trainer.train()
    engine = getattr(trainer, "model_wrapped", None)
    stage = getattr(engine, "zero_optimization_stage", lambda: "?")()
    notes.append(f"engine {type(engine).__module__}.{type(engine).__name__} (ZeRO {stage})")
    return {"step_s": clock.times[a.warmup:], "losses": clock.losses, **load,
            "first_step_s": clock.first_step_s, "comm_per_step": comm.per_step(a.steps),
            "optimizer": _optimizer_name(getattr(trainer, "optimizer", None))}


def _train_initialize(a: argparse.Namespace, lib, notes: list[str]) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    comm = CommCounter()
    lib.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    keep = None
    if a.stage == 3:
        try:
            keep = hf_config_class(a.lib)(plain_config(a, 3))
        except Exception as error:  # a missing piece is a note, not a crash
            notes.append(f"loaded whole: {type(error).__name__}: {error}"[:200])
    before = peak_rss_kib()
    model = AutoModelForCausalLM.from_pretrained(a.model)
    load = {"load_peak_kib": peak_rss_kib(), "before_load_kib": before,
            "loaded_params": local_param_bytes(model)}
    del keep
    config = plain_config(a, a.stage)
    engine, optimizer, _, _ = lib.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    data = batches((a.warmup + a.steps) * world, a.micro_batch, a.vocab)
    times, losses = [], []
    first_step_s = 0.0
    for step in range(a.warmup + a.steps):
        x = data[step * world + rank]
        if step == a.warmup:
            comm.reset()
        dist.barrier()
        start = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        if step == 0:
            first_step_s = since_process_start()
    result = {"step_s": times[a.warmup:], "losses": losses, **load,
              "first_step_s": first_step_s, "comm_per_step": comm.per_step(a.steps),
              "optimizer": _optimizer_name(optimizer)}
    if hasattr(engine, "state_bytes"):
        result["state_bytes"] = engine.state_bytes()
    return result


def _optimizer_name(optimizer) -> str:
    inner = getattr(optimizer, "optimizer", optimizer)
    return type(inner).__name__ if inner is not None else "?"


# ---------------------------------------------------------------- load

def load(a: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    lib = library(a.lib)
    lib.init_distributed()
    keep = hf_config_class(a.lib)(plain_config(a, 3))
    gc.collect()
    before_peak, before_now = peak_rss_kib(), current_rss_kib()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model)
    seconds = time.perf_counter() - start
    after_peak, after_now = peak_rss_kib(), current_rss_kib()
    emit({"before_peak_kib": before_peak, "before_now_kib": before_now,
          "peak_kib": after_peak, "after_now_kib": after_now, "load_s": seconds,
          "params": local_param_bytes(model), "partitioned": keep.is_zero3(),
          "version": getattr(lib, "__version__", "?")})


# ---------------------------------------------------------------- lora

def lora(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    comm = CommCounter()
    torch.set_num_threads(1)
    lib = library(a.lib)
    lib.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    notes: list[str] = []
    try:
        keep = hf_config_class(a.lib)(plain_config(a, 3))
    except Exception as error:  # a missing piece is a note, not a crash
        keep = None
        notes.append(f"base loaded whole: {type(error).__name__}: {error}"[:200])
    base = AutoModelForCausalLM.from_pretrained(a.model)
    base_bytes = local_param_bytes(base)["full"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    del keep
    after_peft = local_param_bytes(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = sum((getattr(p, "ds_numel", None) or p.numel()) * p.element_size()
                          for p in trainable)
    config = plain_config(a, 3)
    engine, _, _, _ = lib.initialize(model=model, model_parameters=trainable, config=config)
    data = batches((a.warmup + a.steps) * world, a.micro_batch, a.vocab)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        x = data[step * world + rank]
        if step == a.warmup:
            comm.reset()
        dist.barrier()
        start = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    result = {"base_bytes": base_bytes, "trainable_bytes": trainable_bytes,
              "comm_per_step": comm.per_step(a.steps),
              "after_peft": after_peft, "after_steps": local_param_bytes(engine.module),
              "step_s": times[a.warmup:], "losses": losses, "peak_rss_kib": peak_rss_kib(),
              "notes": notes, "version": getattr(lib, "__version__", "?")}
    if hasattr(engine, "state_bytes"):
        result["state_bytes"] = engine.state_bytes()
    emit(result)


# ---------------------------------------------------------------- command line

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["make-model", "train", "load", "lora"])
    parser.add_argument("target", help="the model directory (make-model) or the library")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--driver", choices=["trainer", "compat", "initialize"],
                        default="trainer")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    a = parser.parse_args()
    if a.mode == "make-model":
        make_model(a.target, "quick" if a.quick else "full")
        return
    a.lib = a.target
    try:
        {"train": train, "load": load, "lora": lora}[a.mode](a)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # at once: the other rank is killed by the parent anyway


if __name__ == "__main__":
    main()
