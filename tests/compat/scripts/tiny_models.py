"""The tiny models and synthetic data the compat scripts train, in plain torch.

Kept apart from the scripts (as DeepSpeedExamples keeps ``gan_model.py`` apart from
``gan_deepspeed_train.py``) so the single-process references in ``tests/compat`` build the
very same modules and data without importing ``deepspeed``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


class Net(nn.Module):
    """cifar10_deepspeed.py's network, shrunk for 3x8x8 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 2 * 2, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 8 * 2 * 2)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def synthetic_images(count, seed=1234):
    """A CIFAR-shaped dataset: ``count`` 3x8x8 images in [-1, 1] with labels 0-9."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 3, 8, 8, generator=g) * 2 - 1
    labels = torch.randint(0, 10, (count,), generator=g)
    return TensorDataset(images, labels)


def mlp_layer_specs(LayerSpec, width=16, depth=4, inputs=8, classes=4, relu_at_split=False):
    """The pipeline MLP as ``[LayerSpec(...), ...]``: Linear/ReLU pairs, then a classifier.
    ``LayerSpec`` is passed in: deepspeed.pipe's in the script, :func:`plain_spec` in the
    reference. ``relu_at_split``: one more Linear as layer 3, so that the in-place ReLU
    after it is layer 4, where a 2-stage uniform partition starts stage 1: that stage
    works in place on the activation it received."""
    # in-place ReLUs, as AlexNet's in DeepSpeedExamples' pipeline script: a stage may start
    # with one, working on the activation it received
    layers = [LayerSpec(nn.Linear, inputs, width), LayerSpec(nn.ReLU, True)]
    for _ in range(depth - 2):
        layers += [LayerSpec(nn.Linear, width, width), LayerSpec(nn.ReLU, True)]
    if relu_at_split:
        layers.insert(3, LayerSpec(nn.Linear, width, width))
    return [*layers, LayerSpec(nn.Linear, width, classes)]


class plain_spec:
    """A stand-in for LayerSpec that the reference builds itself."""

    def __init__(self, typename, *args):
        self.typename, self.args = typename, args

    def build(self):
        return self.typename(*self.args)


def synthetic_vectors(count, inputs=8, classes=4, seed=4321):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, inputs, generator=g)
    y = torch.randint(0, classes, (count,), generator=g)
    return TensorDataset(x, y)


class Generator(nn.Module):
    """gan_model.py's Generator in miniature: noise (nz) -> a sample (features)."""

    def __init__(self, nz=4, hidden=16, features=8):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, hidden), nn.ReLU(True),
                                  nn.Linear(hidden, features), nn.Tanh())

    def forward(self, noise):
        return self.main(noise)


class Discriminator(nn.Module):
    """gan_model.py's Discriminator in miniature: a sample -> probability it is real."""

    def __init__(self, features=8, hidden=16):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(features, hidden), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(hidden, 1), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1)


def synthetic_real_samples(count, features=8, seed=99):
    """"Real" data for the GAN: a shifted Gaussian squashed into (-1, 1)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.tanh(torch.randn(count, features, generator=g) * 0.5 + 0.3))


class TinyLM(nn.Module):
    """bf16_master_weight/train.py's SimpleTransformerModel reduced to an embedding, one
    MLP block with a LayerNorm and an output projection."""

    def __init__(self, vocab_size=32, hidden_dim=16, max_seq_len=8):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_dim)
        self.pos_embedding = nn.Embedding(max_seq_len, hidden_dim)
        self.norm = nn.LayerNorm(hidden_dim)
        self.ff = nn.Sequential(nn.Linear(hidden_dim, 4 * hidden_dim), nn.GELU(),
                                nn.Linear(4 * hidden_dim, hidden_dim))
        self.output_proj = nn.Linear(hidden_dim, vocab_size)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.embedding(input_ids) + self.pos_embedding(positions)
        x = x + self.ff(self.norm(x))
        return self.output_proj(x)


def token_batch(step, rank, batch_size, seq_len=8, vocab_size=32, seed=42):
    """Rank ``rank``'s (input_ids, labels) for ``step``: random tokens, as train.py's
    default data, drawn per rank so the ranks see different samples."""
    g = torch.Generator().manual_seed(seed * 1000 + step * 16 + rank)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    labels = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return input_ids, labels
