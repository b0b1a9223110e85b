"""Behaviours DeepSpeed's own unit tests check, in an unedited DeepSpeed script (2 ranks,
``import deepspeed`` is deepshard). Each rank saves ``rank<r>.pt``: a dict of what it saw,
by case."""

from __future__ import annotations

import argparse

import deepspeed
import torch

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--out_dir", required=True)
args = p.parse_args()
deepspeed.init_distributed()
rank = torch.distributed.get_rank()
seen: dict = {}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)

    def magic(self, k):
        return f"magic {k}"


def engine_at(stage: int, **extra):
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              **extra}
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    return engine


# 1. tensors taken inside GatheredParameters outlive the block (DeepSpeed: a snapshot)
engine = engine_at(3)
params = list(engine.module.parameters())
with deepspeed.zero.GatheredParameters(params):
    state = {k: v for k, v in engine.module.state_dict().items()}
    whole = [p.data for p in params]
seen["gathered_shapes"] = [tuple(v.shape) for v in state.values()]
seen["gathered_sums"] = [float(v.sum()) for v in state.values()]  # used to crash
seen["gathered_data_sums"] = [float(t.sum()) for t in whole]
seen["released"] = [p.data.numel() for p in params]

# ZeRO-3 parameters carry DeepSpeed's attributes, tracking their real state
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402

head = engine.module.head.weight
seen["ds_ids"] = sorted(p.ds_id for p in params)
seen["status_between"] = head.ds_status.name
with deepspeed.zero.GatheredParameters([head]):
    seen["status_gathered"] = head.ds_status.name
seen["status_after"] = head.ds_status.name
seen["ds_shape"] = tuple(head.ds_shape)
seen["ds_numel"] = head.ds_numel
seen["ds_tensor_numel"] = sum(p.ds_tensor.numel() for p in params)
seen["status_enum"] = head.ds_status is ZeroParamStatus.NOT_AVAILABLE

# zero.Init casts floating tensors made inside it to the config's dtype, through the
# module's wrapper as it is on entry (transformers replaces it to keep torch.arange's dtype)
from deepspeed.runtime.zero import partition_parameters as pp  # noqa: E402

bf16 = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
with deepspeed.zero.Init(config_dict_or_path=bf16):
    seen["init_zeros"] = str(torch.zeros(2).dtype)
    seen["init_arange"] = str(torch.arange(3.0).dtype)
original = pp.zero_wrapper_for_fp_tensor_constructor
pp.zero_wrapper_for_fp_tensor_constructor = (
    lambda fn, *a, **k: fn if fn is pp._orig_torch_arange else original(fn, *a, **k))
with deepspeed.zero.Init(config_dict_or_path=bf16):
    seen["patched_arange"] = str(torch.arange(3.0).dtype)
    seen["patched_zeros"] = str(torch.zeros(2).dtype)
pp.zero_wrapper_for_fp_tensor_constructor = original
seen["after_init"] = str(torch.zeros(2).dtype)

# 4. the engine delegates unknown attributes to the module
seen["magic"] = engine.magic(3)
seen["head_is_module"] = engine.head is engine.module.head
try:
    seen["missing"] = engine.nonexistent
except AttributeError as exc:
    seen["missing"] = str(exc)

# 9. save_checkpoint needs a directory: ValueError, as DeepSpeed
for bad in (None, ""):
    try:
        engine.save_checkpoint(bad)
    except ValueError as exc:
        seen[f"save_{bad!r}"] = type(exc).__name__

# 14. DeepSpeed's AssertionErrors stay catchable as AssertionError
try:
    with engine.no_sync():
        pass
except AssertionError:
    seen["no_sync_stage3"] = "AssertionError"
try:
    deepspeed.initialize(model=None, config={"train_micro_batch_size_per_gpu": 1})
except AssertionError:
    seen["model_none"] = "AssertionError"
engine0 = engine_at(0)
try:
    with engine0.no_sync(), engine0.no_sync():
        pass
except AssertionError:
    seen["no_sync_twice"] = "AssertionError"
try:
    with engine0.no_sync():
        engine0.step()
except AssertionError:
    seen["step_in_no_sync"] = "AssertionError"

# 3. gradient_allreduce_op: "sum" sums the ranks' gradients (stages 0-2), "mean" averages
for stage in (0, 1, 2):
    for op in ("mean", "sum"):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.zeros_(lin.weight)
        eng, *_ = deepspeed.initialize(model=lin, config={
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
            "gradient_allreduce_op": op, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
        eng.backward(eng(torch.full((1, 4), float(rank + 1))).sum())
        eng.step()
        seen[f"allreduce_{op}_{stage}"] = float(-lin.weight.detach().flatten()[0]) if stage < 3 \
            else None
try:
    deepspeed.initialize(model=torch.nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_allreduce_op": "sum",
        "zero_optimization": {"stage": 3}})
except ValueError:
    seen["allreduce_sum_3"] = "refused"
except Exception as exc:  # a UsageError: the one line names the key
    seen["allreduce_sum_3"] = f"refused: {exc}"

# 2. a ZeRO-3 parameter used outside its own module's forward (DeepSpeed's
# test_ext_param_getattr): detected and gathered; training equals plain torch
class ExtLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(16, 16)
        self.linear2 = torch.nn.Linear(16, 16)

    def forward(self, x):
        b = self.linear2(self.linear1(x))
        return torch.nn.functional.linear(b, self.linear1.weight).square().mean()


class Sibling(torch.nn.Module):
    """``b``'s forward reads ``a``'s weight (``a`` is held apart, not inside ``b``)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.b.forward = lambda x: torch.nn.functional.linear(x, self.a.weight) + self.b.bias

    def forward(self, x):
        return self.b(self.a(x)).square().mean()


def ext_losses(cls, stage):
    torch.manual_seed(0)
    model = cls()
    ref = cls()
    ref.load_state_dict(model.state_dict())
    eng, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    got, want = [], []
    for step in range(2):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(step))
        loss = eng(x)
        eng.backward(loss)
        eng.step()
        got.append(float(loss))
        opt.zero_grad()
        ref_loss = ref(x)
        ref_loss.backward()
        opt.step()
        want.append(float(ref_loss))
    with torch.no_grad():
        no_grad = float(eng(x))
    return {"got": got, "want": want, "no_grad": no_grad,
            "released": [p.numel() for p in eng.module.parameters()]}


for cls in (ExtLinear, Sibling):
    seen[f"ext_{cls.__name__}"] = ext_losses(cls, 3)

# engine.allreduce_gradients(): after a synchronising backward nothing changes; after a
# no_sync backward it averages the ranks' gradients (each rank's gradient is rank + 1)
from deepspeed.utils import safe_get_full_grad  # noqa: E402

for stage in (0, 1):
    for sync in (True, False):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 1, bias=False)
        eng, *_ = deepspeed.initialize(model=lin, config={
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
        out = eng(torch.full((1, 4), float(rank + 1))).sum()
        if sync:
            eng.backward(out)
        else:
            with eng.no_sync():
                eng.backward(out)
        eng.allreduce_gradients()
        seen[f"allreduce_gradients_{stage}_{sync}"] = float(safe_get_full_grad(lin.weight)[0, 0])

# 9. ranks saving under different tags, in each checkpoint.tag_validation mode
import os  # noqa: E402

for mode in ("FAIL", "Warn", "ignore"):
    eng = engine_at(1, checkpoint={"tag_validation": mode})
    where = f"{args.out_dir}/tags_{mode}"
    try:
        eng.save_checkpoint(where, tag=f"tag_rank{rank}")
        torch.distributed.barrier()
        path, _ = eng.load_checkpoint(where)
        seen[f"tags_{mode}"] = {"saved": sorted(os.listdir(where)),
                                "loaded": os.path.basename(os.path.dirname(path + "/"))}
    except AssertionError as exc:
        seen[f"tags_{mode}"] = {"error": "AssertionError", "message": str(exc),
                                "written": sorted(os.listdir(where)) if os.path.isdir(where)
                                else []}

# 13. an EmbeddingBag(sparse=True) trains as a dense reference on the whole batch
def bag_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, mode="mean", sparse=True),
                               torch.nn.Linear(4, 1))


g = torch.Generator().manual_seed(3)
batches = [(torch.randint(0, 10, (4, 3), generator=g), torch.randn(4, 1, generator=g))
           for _ in range(3)]
ref = bag_model()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
want = []
for x, y in batches:
    loss = torch.nn.functional.mse_loss(ref(x), y)
    ref_opt.zero_grad()
    loss.backward()
    ref_opt.step()
    want.append(float(loss))
for stage in (0, 1, 2):
    eng, *_ = deepspeed.initialize(model=bag_model(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}}})
    got = []
    for x, y in batches:
        mine = slice(2 * rank, 2 * rank + 2)
        loss = torch.nn.functional.mse_loss(eng(x[mine]), y[mine])
        eng.backward(loss)
        eng.step()
        whole = loss.detach().clone()
        torch.distributed.all_reduce(whole)
        got.append(float(whole) / 2)
    seen[f"sparse_bag_{stage}"] = {"got": got, "want": want}

torch.save(seen, f"{args.out_dir}/rank{rank}.pt")
