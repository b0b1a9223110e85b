"""A 1F1B batch on real gloo groups: the 2x2x2 grid's groups checked by collectives, then
a 4-stage x 2-replica pipeline with a tied layer run from ``one_f_one_b`` with blocking
``dist.send``/``dist.recv``. Prints one RESULT line per rank. The test imports
``layers`` and ``batch`` to compute the single-process reference."""

import json

import torch
import torch.distributed as dist
from torch import nn

M, B = 6, 3  # micro-batches, samples per micro-batch
WIDTH = 8


def layers():
    """8 layers; split uniformly over 4 stages, "sq" is tied across stages 1 and 3."""
    tied = dict(tied_weight_attr=["weight", "bias"])
    from deepshard.runtime.parallel.pipe_module import LayerSpec, TiedLayerSpec

    return [LayerSpec(nn.Linear, 4, WIDTH), LayerSpec(nn.Tanh),
            TiedLayerSpec("sq", nn.Linear, WIDTH, WIDTH, **tied), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Tanh),
            TiedLayerSpec("sq", nn.Linear, WIDTH, WIDTH, **tied), LayerSpec(nn.Linear, WIDTH, 4)]


def batch(data: int):
    """Inputs and labels ``[M, B, 4]`` of data-parallel replica ``data``."""
    gen = torch.Generator().manual_seed(100 + data)
    return torch.randn(M, B, 4, generator=gen), torch.randn(M, B, 4, generator=gen)


def check_groups(rank: int, world: int) -> dict:
    from deepshard.runtime.parallel.topology import ProcessGroups, Topology

    pg = ProcessGroups.create(Topology.from_config(world, pipe_stages=2, tp_size=2))
    seen = {}
    for axis, group, mpu_rank, mpu_size in [
        ("pipe", pg.get_pipeline_model_parallel_group(), pg.get_pipeline_model_parallel_rank(),
         pg.get_pipeline_model_parallel_world_size()),
        ("data", pg.get_data_parallel_group(), pg.get_data_parallel_rank(),
         pg.get_data_parallel_world_size()),
        ("tensor", pg.get_tensor_model_parallel_group(), pg.get_tensor_model_parallel_rank(),
         pg.get_tensor_model_parallel_world_size()),
        ("model", pg.get_model_parallel_group(), pg.get_model_parallel_rank(),
         pg.get_model_parallel_world_size()),
    ]:
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=group)
        seen[axis] = {"sum": total.item(), "size": dist.get_world_size(group),
                      "group_rank": dist.get_rank(group), "mpu": [mpu_rank, mpu_size]}
    # p2p with the neighbour stages (stage 0 sends, stage 1 receives)
    token = torch.tensor([float(rank)])
    if pg.next_stage_rank is not None:
        dist.send(token, pg.next_stage_rank)
    else:
        dist.recv(token, pg.prev_stage_rank)
    seen["p2p"] = [pg.prev_stage_rank, pg.next_stage_rank, token.item()]
    return seen


def train_batch(rank: int, world: int) -> dict:
    from deepshard.runtime.parallel import schedule as S
    from deepshard.runtime.parallel.pipe_module import PipelineModule
    from deepshard.runtime.parallel.tied import TiedWeightGroups
    from deepshard.runtime.parallel.topology import ProcessGroups, Topology

    topo = Topology.from_config(world, pipe_stages=4)
    pg = ProcessGroups.create(topo)
    module = PipelineModule(layers(), topology=topo, partition_method="uniform",
                            seed_layers=True, loss_fn=nn.functional.mse_loss)
    tied = TiedWeightGroups.create(module, topo)
    tied.broadcast_weights(module)
    x, y = batch(pg.get_data_parallel_rank())
    inputs, outputs, grads, to_send, labels, losses = {}, {}, {}, {}, {}, []
    prev, nxt = pg.prev_stage_rank, pg.next_stage_rank
    for action in S.one_f_one_b(module.num_stages, module.stage_id, M):
        mb = getattr(action, "mb", None)
        if isinstance(action, S.LoadMicroBatch):
            if module.is_first_stage:
                inputs[mb] = x[mb]
            if module.is_last_stage:
                labels[mb] = y[mb]
        elif isinstance(action, S.RecvActivation):
            buf = torch.empty(B, WIDTH)
            dist.recv(buf, prev)
            inputs[mb] = buf.requires_grad_()
        elif isinstance(action, S.Forward):
            out = module(inputs[mb])
            if module.is_last_stage:
                out = module.loss_fn(out, labels.pop(mb)) / M
                losses.append(out.item())
            outputs[mb] = out
        elif isinstance(action, S.SendActivation):
            dist.send(outputs[mb].detach(), nxt)
        elif isinstance(action, S.RecvGrad):
            grads[mb] = torch.empty(B, WIDTH)
            dist.recv(grads[mb], nxt)
        elif isinstance(action, S.Backward):
            torch.autograd.backward(outputs.pop(mb), grads.pop(mb, None))
            sent = inputs.pop(mb)  # activations of mb are freed here
            if not module.is_first_stage:
                to_send[mb] = sent.grad
        elif isinstance(action, S.SendGrad):
            dist.send(to_send.pop(mb), prev)
        elif isinstance(action, S.ReduceTiedGrads):
            tied.all_reduce_grads(module)
        elif isinstance(action, S.ReduceGrads):
            for param in module.parameters():
                dist.all_reduce(param.grad, group=pg.get_data_parallel_group())
                param.grad /= pg.get_data_parallel_world_size()
    return {"stage": module.stage_id, "data": pg.get_data_parallel_rank(),
            "loss": sum(losses),
            "left": [len(inputs), len(outputs), len(grads), len(to_send), len(labels)],
            "grads": {n: p.grad.flatten().tolist() for n, p in module.named_parameters()}}


if __name__ == "__main__":
    import deepshard

    deepshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "groups": check_groups(rank, world),
              "pipe": train_batch(rank, world)}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
