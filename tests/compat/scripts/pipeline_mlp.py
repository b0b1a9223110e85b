"""Pipeline parallelism as DeepSpeedExamples' training/pipeline_parallelism/train.py does it,
on a small MLP: the model is a list of LayerSpecs, a PipelineModule cuts it into stages,
and engine.train_batch() runs each step's micro-batches through the 1F1B schedule.

    deepspeed --num_gpus 2 pipeline_mlp.py --deepspeed_config pipeline_config.json -p 2

With --out_dir, every rank saves the losses train_batch returned and its stage's weights.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import RepeatingLoader
from tiny_models import mlp_layer_specs, synthetic_vectors
from torch.utils.data import DataLoader


def get_args():
    parser = argparse.ArgumentParser(description="MLP pipeline")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=4, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2,
                        help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--relu_at_split", action="store_true",
                        help="stage 1 starts with an in-place ReLU (uniform partition)")
    parser.add_argument("--training_data", action="store_true",
                        help="give initialize the dataset and call train_batch() with no "
                             "iterator, as DeepSpeedExamples' pipeline_parallelism/train.py")
    parser.add_argument("--out_dir", default=None, type=str,
                        help="where each rank saves its losses and final weights")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_pipe(args):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)

    # seed_layers: each layer is built from base_seed + its index, whichever stage owns it
    # (seed_fn: DeepSpeed 0.19.8's default seeds Python's random with a numpy integer,
    # which Python 3.11 refuses)
    net = PipelineModule(layers=mlp_layer_specs(LayerSpec, relu_at_split=args.relu_at_split),
                         loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size,
                         partition_method="uniform" if args.relu_at_split else "parameters",
                         seed_layers=True,
                         seed_fn=torch.manual_seed,
                         activation_checkpoint_interval=0)

    with open(args.deepspeed_config) as f:
        samples = json.load(f)["train_batch_size"] * args.steps
    trainset = synthetic_vectors(samples)
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset if args.training_data else None)

    # Every stage iterates the same loader: the first uses the inputs, the last the labels.
    loader = DataLoader(trainset, batch_size=engine.train_micro_batch_size_per_gpu(),
                        shuffle=False)
    data_iter = None if args.training_data else iter(RepeatingLoader(loader))

    losses = []
    for step in range(args.steps):
        loss = engine.train_batch(data_iter=data_iter)
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step: {step + 1:3d} / {args.steps:3d} loss: {loss.item():.6f}")

    if args.out_dir:
        state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
        torch.save({"losses": losses, "state": state, "stage": engine.stage_id},
                   os.path.join(args.out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()


if __name__ == "__main__":
    args = get_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    train_pipe(args)
