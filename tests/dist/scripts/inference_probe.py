"""``init_inference`` on every rank of a ds-run job, against one process's dense model.

argv: ``[--local_rank=N] MODELS_DIR CHECKS`` where MODELS_DIR holds the tiny HF models
(``tests/inference_models.py``) and CHECKS is a comma list of: ``families`` (logits,
greedy, beam search and seeded sampling of every family, each loaded from its HF directory
onto a meta-device model), ``int8`` (token agreement and perplexity against fp32),
``inject`` (``replace_with_kernel_inject``: same tokens), ``policy`` (a block AutoTP has
no rule for: refused, then split by ``injection_policy``), ``pipeline`` (an HF text-generation
pipeline whose model is replaced by the engine), ``zero3`` (a ZeRO-3 training checkpoint
loaded straight into the shards). Prints one `` RESULT {json}`` line per check and rank.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import deepshard
from tests.inference_models import configs

NEW = 8


def report(check: str, **data) -> None:
    print(" RESULT " + json.dumps({"check": check, "rank": dist.get_rank(), **data}),
          flush=True)


def same_on_all(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(p, t) for p in parts)


def load(family: str, root: Path, meta: bool):
    import transformers as T

    auto = getattr(T, configs()[family][0])
    if not meta:
        return auto.from_pretrained(root / family).eval()
    with torch.device("meta"):
        return auto.from_config(T.AutoConfig.from_pretrained(root / family))


def engine_for(family: str, root: Path, **kw):
    world = dist.get_world_size()
    kw = {"dtype": torch.float32, "checkpoint": str(root / family), **kw}
    return deepshard.init_inference(load(family, root, meta=True),
                                    tensor_parallel={"tp_size": world}, **kw)


def prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(5))


def logits(model, ids: torch.Tensor, seq2seq: bool) -> torch.Tensor:
    with torch.no_grad():
        if seq2seq:
            return model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits
        return model(input_ids=ids).logits


def generations(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    mask = torch.ones_like(ids)
    common = {"attention_mask": mask, "max_new_tokens": NEW, "min_new_tokens": NEW,
              "pad_token_id": 0}
    out = {"greedy": model.generate(ids, do_sample=False, **common),
           "beam": model.generate(ids, do_sample=False, num_beams=3, **common)}
    torch.manual_seed(123)
    out["sample"] = model.generate(ids, do_sample=True, top_k=20, **common)
    return out


def check_families(root: Path) -> None:
    for family, (auto, config) in configs().items():
        seq2seq = auto == "AutoModelForSeq2SeqLM"
        ref = load(family, root, meta=False)
        engine = engine_for(family, root)
        ids = prompt(config.vocab_size)
        diff = (logits(engine, ids, seq2seq) - logits(ref, ids, seq2seq)).abs().max().item()
        mine, theirs = generations(engine, ids), generations(ref, ids)
        split = [e.name for e in engine.report.plan.entries if e.kind != "replicate"]
        report("families", family=family, max_logit_diff=diff,
               equal={k: torch.equal(mine[k], theirs[k]) for k in mine},
               same_on_all_ranks={k: same_on_all(mine[k]) for k in mine},
               heads=[a.strategy for a in engine.report.plan.attention],
               split=len(split), read_whole=sorted(engine.report.split_read_whole),
               local_bytes=engine.report.local_bytes,
               dense_bytes=sum(p.numel() * 4 for p in ref.parameters()))


def perplexity(model, text: torch.Tensor) -> float:
    with torch.no_grad():
        out = model(input_ids=text).logits[:, :-1].float()
    return math.exp(F.cross_entropy(out.reshape(-1, out.shape[-1]), text[:, 1:].reshape(-1)))


def check_int8(root: Path) -> None:
    for family in ("llama", "gpt2"):
        vocab = configs()[family][1].vocab_size
        fp32, int8 = engine_for(family, root), engine_for(family, root, dtype=torch.int8)
        ids = prompt(vocab)
        common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 24,
                  "min_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
        a, b = fp32.generate(ids, **common), int8.generate(ids, **common)
        agree = (a[:, ids.shape[1]:] == b[:, ids.shape[1]:]).float().mean().item()
        with torch.no_grad():  # teacher-forced: next-token argmax on the same text
            top1 = (fp32(input_ids=a).logits.argmax(-1) == int8(input_ids=a).logits.argmax(-1))
        top1 = top1.float().mean().item()
        kernels = sorted({m._kernel.name for m in int8.module.modules()
                          if getattr(m, "_kernel", None) is not None})
        report("int8", family=family, agreement=agree, top1_agreement=top1,
               ppl_fp32=perplexity(fp32, a), ppl_int8=perplexity(int8, a), kernels=kernels,
               bytes_fp32=fp32.report.local_bytes,
               bytes_int8=sum(t.numel() * t.element_size() for t in
                              [*int8.module.parameters(), *int8.module.buffers()]),
               same_on_all_ranks=same_on_all(b))


def check_inject(root: Path) -> None:
    for family in ("llama", "gpt2"):
        vocab = configs()[family][1].vocab_size
        ids = prompt(vocab)
        plain = engine_for(family, root)
        plain.module.set_attn_implementation("eager")
        fused = engine_for(family, root, replace_with_kernel_inject=True)
        common = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0}
        report("inject", family=family,
               attention=fused.module.config._attn_implementation,
               equal=torch.equal(plain.generate(ids, **common), fused.generate(ids, **common)))


def check_pipeline(root: Path) -> None:
    from transformers import pipeline

    ref = pipeline("text-generation", model=str(root / "gpt2"))
    pipe = pipeline("text-generation", model=str(root / "gpt2"))
    pipe.model = deepshard.init_inference(pipe.model,
                                          tensor_parallel={"tp_size": dist.get_world_size()},
                                          dtype=torch.float32)
    kw = {"max_new_tokens": NEW, "do_sample": False}
    mine, theirs = pipe("w5 w6 w7", **kw), ref("w5 w6 w7", **kw)
    report("pipeline", text=mine[0]["generated_text"], equal=mine == theirs,
           engine=type(pipe.model).__name__)


def check_zero3(root: Path, work: Path) -> None:
    from deepshard.runtime.checkpoint.consolidate import get_fp32_state_dict

    model = load("llama", root, meta=False).train()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepshard.initialize(model=model, config=config,
                                      model_parameters=model.parameters())
    ids = prompt(configs()["llama"][1].vocab_size)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    ckpt = work / "zero3"
    engine.save_checkpoint(str(ckpt))
    dist.barrier()
    dense = load("llama", root, meta=False)
    dense.load_state_dict(get_fp32_state_dict(str(ckpt)), strict=False)
    served = engine_for("llama", root, checkpoint=str(ckpt))
    diff = (logits(served, ids, False) - logits(dense, ids, False)).abs().max().item()
    moved = (logits(dense, ids, False) - logits(load("llama", root, meta=False), ids,
                                                 False)).abs().max().item()
    report("zero3", max_logit_diff=diff, trained_moved=moved,
           read_whole=sorted(served.report.split_read_whole))


class Mixer(torch.nn.Module):
    """A block AutoTP has no rule for: two square Linears with unknown names."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix_in = torch.nn.Linear(width, width)
        self.mix_out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix_out(torch.tanh(self.mix_in(x)))


def check_policy(root: Path) -> None:
    del root
    world = dist.get_world_size()

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(Mixer(16), Mixer(16))

    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    try:
        deepshard.init_inference(build(), tensor_parallel={"tp_size": world}, dtype=torch.float32)
        refused = ""
    except deepshard.UsageError as exc:
        refused = str(exc)
    engine = deepshard.init_inference(build(), tensor_parallel={"tp_size": world},
                                      dtype=torch.float32,
                                      injection_policy={Mixer: ("mix_out",)})
    with torch.no_grad():
        diff = (engine(x) - build()(x)).abs().max().item()
    report("policy", refused=refused, max_diff=diff,
           kinds=sorted({e.kind for e in engine.report.plan.entries}))


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    root, checks = Path(args[0]), args[1].split(",")
    deepshard.init_distributed()
    for check in checks:
        if check == "zero3":
            check_zero3(root, Path(args[2]))
        else:
            globals()[f"check_{check}"](root)
    dist.barrier()


if __name__ == "__main__":
    main()
