"""Ulysses sequence parallelism as DeepSpeed users write it for their own model: the
attention's core wrapped in ``deepspeed.sequence.layer.DistributedAttention`` over a
sequence-parallel group made with torch.distributed (as DeepSpeedExamples'
benchmarks/autosp/sp_dp_registry.py makes it: blocks of ``--sp_size`` consecutive ranks),
each rank's batches sharded along the sequence by ALST's ``UlyssesSPDataLoaderAdapter``,
and the loss averaged over the group's valid tokens as the ALST tutorial does it
(``torch.distributed.nn.functional.all_gather`` of each rank's loss and token count).

    deepspeed --num_gpus 2 ulysses_attention.py --sp_size 2 --stage 0

With --out_dir, every rank saves its per-step losses and final weights there.
"""

import argparse
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
from deepspeed.sequence.layer import DistributedAttention
from ulysses_model import VOCAB, TinyAttentionLM, TokenDataset, causal_attention


def get_args():
    parser = argparse.ArgumentParser(description="Ulysses SP (tiny attention LM)")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--sp_size", type=int, default=2, help="sequence parallel size")
    parser.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3],
                        help="ZeRO stage")
    parser.add_argument("--micro_batch", type=int, default=2, help="sequences per batch")
    parser.add_argument("--samples", type=int, default=8, help="size of the training set")
    parser.add_argument("--seed", type=int, default=1234, help="PRNG seed")
    parser.add_argument("--out_dir", default=None, type=str,
                        help="where each rank saves its losses and final weights")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def sequence_parallel_group(sp_size):
    """This rank's group of ``sp_size`` consecutive ranks (every rank creates them all)."""
    mine = None
    for start in range(0, dist.get_world_size(), sp_size):
        ranks = list(range(start, start + sp_size))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8,
                                 "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
    }


def sp_loss(logits, shift_labels, sp_group):
    """The mean over the group's valid tokens: each rank's mean loss weighted by its
    count of labels that are not -100 (ALST's tutorial)."""
    loss = F.cross_entropy(logits.view(-1, VOCAB), shift_labels.reshape(-1),
                           ignore_index=-100)
    good = (shift_labels != -100).sum()
    losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
    good_per_rank = torch.distributed.nn.functional.all_gather(good, group=sp_group)
    total = sum(losses_per_rank[r] * good_per_rank[r] for r in range(len(losses_per_rank))
                if good_per_rank[r] > 0)
    return total / max(sum(good_per_rank), 1)


def main(args):
    deepspeed.init_distributed()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))
    sp_group = sequence_parallel_group(args.sp_size)
    sp_rank, sp_world = dist.get_rank(group=sp_group), dist.get_world_size(group=sp_group)

    torch.manual_seed(args.seed)
    attention = DistributedAttention(causal_attention, sp_group, scatter_idx=2, gather_idx=1)
    model = TinyAttentionLM(attention)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(args))
    device = get_accelerator().device_name(engine.local_rank)

    dataset = TokenDataset(args.samples)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch,
                                         sampler=sampler, drop_last=True)
    loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=sp_rank, sp_group=sp_group,
                                        sp_world_size=sp_world, device=device)
    losses = []
    for step, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = engine(batch["input_ids"], batch["position_ids"])
        loss = sp_loss(logits, batch["shift_labels"], sp_group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}")

    if args.out_dir:
        state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
        torch.save({"losses": losses, "state": state},
                   os.path.join(args.out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(get_args())
