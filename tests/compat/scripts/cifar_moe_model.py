"""cifar10_deepspeed.py's ``Net`` with ``--moe``, shrunk for 3x8x8 images, in plain torch.

The MoE layer class is passed in (``deepspeed.moe.layer.MoE`` in the script, deepshard's
at ``ep_size`` 1 in the single-process reference), so both build the very same module
without the reference importing ``deepspeed``. As in the example, every expert is a deep
copy of one ``fc3`` and the layers' auxiliary losses are left out of the loss.
"""

import torch.nn as nn
import torch.nn.functional as F

HIDDEN = 16


class Net(nn.Module):
    def __init__(self, args, moe_class):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 2 * 2, 24)
        self.fc2 = nn.Linear(24, HIDDEN)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(HIDDEN, HIDDEN)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # Create moe layers based on the number of experts.
                self.moe_layer_list.append(
                    moe_class(
                        hidden_size=HIDDEN,
                        expert=fc3,
                        num_experts=n_e,
                        ep_size=args.ep_world_size,
                        use_residual=args.mlp_type == "residual",
                        k=args.top_k,
                        min_capacity=args.min_capacity,
                        noisy_gate_policy=args.noisy_gate_policy,
                    )
                )
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(HIDDEN, 10)
        else:
            self.fc3 = nn.Linear(HIDDEN, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 8 * 2 * 2)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x
