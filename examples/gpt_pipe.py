"""``examples/gpt.py``'s GPT as a DeepSpeed ``PipelineModule``: the same function, the same
initial weights, cut into pipeline stages.

The layer list is ``[GPTEmbedding, Block x n_layer, GPTHead]`` and ``gpt_loss`` is the
cross-entropy ``GPT.forward`` computes, so that ``gpt_loss(layers(idx), targets)`` equals
``GPT(cfg)(idx, targets)``. Between stages travels one tensor, the hidden states
``[batch, seq, d_model]``; the targets reach ``gpt_loss`` on the last stage as labels.

Exact initial values: :func:`pipe_gpt` builds the dense ``GPT(cfg)`` right after
``torch.manual_seed(seed)`` (as a single-process script does), then copies its weights
into this stage's layers by name (:func:`gpt_param_name`), and finally puts torch's CPU
random generator back where building ``GPT(cfg)`` left it. So every stage on every rank
starts from exactly the single-process model's weights, and the generator state (for
dropout, say) is what the single-process script would see next. Building the dense model
on every rank is cheap at example sizes (the reference GPT is 27.4M parameters).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpt import GPT, Block, GPTConfig
from torch import nn

from deepshard.runtime.parallel.pipe_module import LayerSpec, PipelineModule
from deepshard.runtime.parallel.topology import Topology

__all__ = ["GPTEmbedding", "GPTHead", "gpt_layers", "gpt_loss", "gpt_param_name", "pipe_gpt"]


class GPTEmbedding(nn.Module):
    """Layer 0: token + learned position embeddings, token ids ``[b, t]`` -> ``[b, t, d]``.
    Parameter names match ``GPT``'s (``tok_emb``, ``pos_emb``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)


class GPTHead(nn.Module):
    """The last layer: final LayerNorm and the untied output projection, ``[b, t, d]`` ->
    logits ``[b, t, vocab]``. Parameter names match ``GPT``'s (``ln_f``, ``head``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``GPT.forward(idx, targets)`` (in fp32), as the
    PipelineModule's ``loss_fn(outputs, labels)``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def gpt_layers(cfg: GPTConfig) -> list[LayerSpec]:
    """The GPT as ``n_layer + 2`` layer blueprints: embedding, one ``gpt.Block`` each, head.

    Blueprints, so a ``PipelineModule`` builds only its own stage's layers; their weights
    are then initialised by the module's own rules, not ``GPT``'s (see :func:`pipe_gpt`).
    """
    return [LayerSpec(GPTEmbedding, cfg), *(LayerSpec(Block, cfg) for _ in range(cfg.n_layer)),
            LayerSpec(GPTHead, cfg)]


_LAYER = re.compile(r"(\d+)\.(.+)")


def gpt_param_name(name: str, cfg: GPTConfig) -> str:
    """The ``GPT`` state-dict key of a ``PipelineModule`` key built from
    :func:`gpt_layers` (layers are named by their global index): ``0.tok_emb.weight`` ->
    ``tok_emb.weight``, ``3.qkv.bias`` -> ``blocks.2.qkv.bias``, ``<n_layer + 1>.head.
    weight`` -> ``head.weight``."""
    match = _LAYER.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a key of a PipelineModule built from gpt_layers")
    index, rest = int(match.group(1)), match.group(2)
    if index == 0 or index == cfg.n_layer + 1:
        return rest
    if 1 <= index <= cfg.n_layer:
        return f"blocks.{index - 1}.{rest}"
    raise ValueError(f"{name!r}: layer {index} outside 0..{cfg.n_layer + 1}")


def pipe_gpt(cfg: GPTConfig, num_stages: int | None = None, seed: int = 0, *,
             topology: Topology | None = None, partition_method: str = "parameters",
             activation_checkpoint_interval: int = 0,
             activation_checkpoint_func: Callable | None = None,
             stage_id: int | None = None, rank: int | None = None) -> PipelineModule:
    """This process's stage of the GPT, with ``GPT(cfg)``'s initial weights under ``seed``.

    Args:
        cfg: the model shape.
        num_stages: pipeline stages (or give ``topology``).
        seed: the weights are those of ``GPT(cfg)`` built right after
            ``torch.manual_seed(seed)``; torch's CPU generator is left in the state that
            construction leaves it in.
        topology: the job's grid; needed when tensor parallelism is on too (without it
            the stage comes from the rank with a pipe x data grid).
        partition_method, activation_checkpoint_interval, activation_checkpoint_func,
        stage_id, rank: passed to :class:`PipelineModule` (``stage_id`` builds one stage
            without ``torch.distributed``).
    """
    torch.manual_seed(seed)
    dense = GPT(cfg).state_dict()
    after_init = torch.get_rng_state()
    module = PipelineModule(gpt_layers(cfg), num_stages=num_stages, topology=topology,
                            loss_fn=gpt_loss, partition_method=partition_method,
                            activation_checkpoint_interval=activation_checkpoint_interval,
                            activation_checkpoint_func=activation_checkpoint_func,
                            stage_id=stage_id, rank=rank)
    own = module.state_dict()
    module.load_state_dict({name: dense[gpt_param_name(name, cfg)] for name in own},
                           strict=True)
    torch.set_rng_state(after_init)
    return module
