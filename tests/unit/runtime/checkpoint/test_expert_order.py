"""``expert_order``: a consolidated MoE checkpoint lists each layer's experts once, by
global id, in the order of a module holding every expert (``ep_size`` 1)."""

from __future__ import annotations

from deepshard.runtime.checkpoint.consolidate import expert_order

E = "moe.deepspeed_moe.experts.deepspeed_experts"


def _expert(g: int, layer: str = "moe") -> list[str]:
    head = E.replace("moe.", f"{layer}.", 1)
    return [f"{head}.{g}.0.weight", f"{head}.{g}.0.bias", f"{head}.{g}.2.weight"]


def test_rank_0s_local_experts_become_every_expert_by_global_id():
    order = ["inp.weight", *_expert(0), *_expert(1), "out.weight"]  # ep 2, rank 0
    names = ["out.weight", *_expert(3)[::-1], *_expert(1), *_expert(2), *_expert(0),
             "inp.weight"]
    assert expert_order(order, names) == ["inp.weight", *_expert(0), *_expert(1),
                                          *_expert(2), *_expert(3), "out.weight"]


def test_layers_stay_apart_and_other_names_keep_their_place():
    order = ["a", *_expert(0, "l0"), "b", *_expert(0, "l1"), "c"]  # ep 4: one each
    names = [*_expert(1, "l1"), *_expert(0, "l1"), *_expert(1, "l0"), *_expert(0, "l0")]
    assert expert_order(order, names) == ["a", *_expert(0, "l0"), *_expert(1, "l0"), "b",
                                          *_expert(0, "l1"), *_expert(1, "l1"), "c"]
