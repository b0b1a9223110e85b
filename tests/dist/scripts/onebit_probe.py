"""1-bit compression on real gloo ranks; prints one RESULT line per rank.

``compressed``: the compressed all-reduce, several calls in a row for a few (odd) sizes,
against ``simulate`` of every rank's inputs (each rank makes all ranks' inputs from the same
seeds), compared exactly: the result and both error buffers; plus the bytes it sent and the
comms logger's records.

``adam``: OneBitAdam with the engine's protocol emulated (gradients all-reduced while
``communicates_next_step()`` is False), against ``ReferenceOneBitAdam`` simulating every rank
in this process, compared exactly after every step; the bytes of a compressed step.

``converge``: a least-squares regression, each rank on its own data: the final loss of Adam
(DeepSpeed's update on all-reduced gradients throughout), of 1-bit Adam, and of 1-bit Adam with
its errors reset before every step (no error feedback).
"""

import json
import sys
from pathlib import Path

import torch

import deepshard.comm as comm
from deepshard.runtime.optim.onebit.adam import OneBitAdam
from deepshard.runtime.optim.onebit.compressed import CompressedAllreduce

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.unit.runtime.optim.onebit.reference import ReferenceOneBitAdam

SIZES = (1, 37, 200, 1000)
CALLS = 4


def inputs(size: int, call: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * size + call)
    return [torch.randn(size, generator=gen) * (r + 1) for r in range(world)]


def check_compressed(rank: int, world: int) -> dict:
    car = CompressedAllreduce()
    same, nonzero, bytes_sent = {}, {}, {}
    for size in SIZES:
        padded = car.padded_numel(size)
        mine = car.new_errors(size)
        refs = [car.new_errors(size) for _ in range(world)]
        ok, errs = True, True
        for call in range(CALLS):
            xs = inputs(size, call, world)
            buffers = [torch.zeros(padded) for _ in range(world)]
            for b, x in zip(buffers, xs, strict=True):
                b[:size] = x
            buffer = buffers[rank].clone()
            car(buffer, *mine)
            car.simulate(buffers, [w for w, _ in refs], [s for _, s in refs])
            ok = ok and torch.equal(buffer, buffers[rank]) and torch.equal(
                mine[0], refs[rank][0]) and torch.equal(mine[1], refs[rank][1])
            errs = errs and bool(mine[0].abs().sum() > 0) and bool(mine[1].abs().sum() > 0)
        same[str(size)], nonzero[str(size)] = ok, errs
        bytes_sent[str(size)] = [padded, car.last_bytes_sent]
    return {"same": same, "errors_nonzero": nonzero, "bytes": bytes_sent}


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def local_backward(model: torch.nn.Module, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    model.zero_grad()
    model(torch.randn(5, 9, generator=gen)).square().mean().backward()


def engine_step(opt: OneBitAdam, params: list[torch.Tensor], world: int) -> None:
    """What the engine does around ``step()``: all-reduce unless the optimizer will."""
    if not opt.communicates_next_step():
        for p in params:
            comm.all_reduce(p.grad)
            p.grad.div_(world)
    opt.step()


def check_adam(rank: int, world: int) -> dict:
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, freeze_step=3)
    model, copies = net(), [net() for _ in range(world)]
    params = list(model.parameters())
    opt = OneBitAdam(params, **hp)
    ref = ReferenceOneBitAdam([list(c.parameters()) for c in copies], **hp)
    same, protocol, sent = [], [], []
    for step in range(8):
        protocol.append(opt.communicates_next_step())
        local_backward(model, step, rank)
        for r, c in enumerate(copies):
            local_backward(c, step, r)
        engine_step(opt, params, world)
        ref.step([[p.grad for p in c.parameters()] for c in copies])
        same.append(all(torch.equal(p, q) for p, q in zip(params, copies[rank].parameters(),
                                                          strict=True)))
        sent.append(opt.last_bytes_sent)
    errors = opt.error_state()
    big = torch.nn.Linear(1000, 1000)
    big_opt = OneBitAdam(big.parameters(), freeze_step=0)
    big(torch.ones(2, 1000)).sum().backward()
    engine_step(big_opt, list(big.parameters()), world)
    return {"big": [sum(p.numel() for p in big.parameters()), big_opt.last_bytes_sent],
            "same": same, "protocol": protocol, "sent": sent,
            "numel": sum(p.numel() for p in params), "comm_bytes": opt.comm_bytes,
            "errors": {k: [v.numel(), v.norm().item()] for k, v in errors.items()},
            "ref_errors": [ref.workers[rank].norm().item(), ref.servers[rank].norm().item()],
            "state_keys": sorted({k for s in opt.state_dict()["state"].values() for k in s})}


def regression_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(32, 4, generator=gen)
    gen.manual_seed(rank + 11)
    x = torch.randn(128, 32, generator=gen) + 0.5 * rank
    return x, x @ w + 0.1 * torch.randn(128, 4, generator=gen)


def train(rank: int, world: int, freeze_step: int, feedback: bool, steps: int = 200,
          lr: float = 3e-2) -> float:
    """The final loss over all ranks' data, the learning rate decaying linearly to 0."""
    x, y = regression_data(rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 4)
    params = list(model.parameters())
    opt = OneBitAdam(params, lr=lr, betas=(0.9, 0.999), freeze_step=freeze_step)
    for step in range(steps):
        opt.param_groups[0]["lr"] = lr * (1 - step / steps)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if not feedback:
            opt.load_error_state(None)
        engine_step(opt, params, world)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).reshape(1)
    comm.all_reduce(loss)
    return loss.item() / world


def check_converge(rank: int, world: int) -> dict:
    # 1-bit Adam's variance freezes after 30% of the steps
    return {"adam": train(rank, world, 10**6, True), "onebit": train(rank, world, 60, True),
            "no_feedback": train(rank, world, 60, False)}


def main() -> None:
    comm.init_distributed(verbose=False)
    comm.configure(enabled=True, prof_all=True)
    rank, world = comm.get_rank(), comm.get_world_size()
    result = {"rank": rank, "world": world}
    mode = next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))
    if mode == "compressed":
        result.update(check_compressed(rank, world))
    elif mode == "adam":
        result.update(check_adam(rank, world))
    elif mode == "converge":
        result.update(check_converge(rank, world))
    from deepshard.comm.logger import comms_logger

    result["counts"] = {name: {str(size): row.count for size, row in sizes.items()}
                        for name, sizes in comms_logger.comms_dict.items()}
    print("RESULT " + json.dumps(result), flush=True)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
