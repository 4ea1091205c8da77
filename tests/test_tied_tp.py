"""How a tp plan lays out the holders of a tied parameter (meshpipe/parallel/tied_tp.py), in
one process: a head sharded while the embedding it is tied to stays whole is found, across
stages and within one; holders sharded alike pass, except across stage meshes."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshpipe.parallel.tied_tp import param_layout, shared_within, tied_mismatches
from meshpipe.split.tied import find_tied


def _stages() -> list[nn.Module]:
    first, last = nn.Module(), nn.Module()
    first.emb = nn.Embedding(16, 8)
    last.head = nn.Linear(8, 16, bias=False)
    last.head.weight = first.emb.weight  # tied across the two stages
    return [first, last]


def test_a_sharded_head_tied_to_a_whole_embedding_is_found() -> None:
    stages = _stages()
    tied = find_tied(stages)
    assert tied == [{0: "emb.weight", 1: "head.weight"}]
    bad = tied_mismatches(stages, {"head": ColwiseParallel()}, tied, [2, 2])
    assert bad == [
        ("emb.weight", [(0, "emb", "whole"),
                        (1, "head", "sharded on dim 0 over tp=2")]),
    ]  # fmt: skip
    # both sharded by rows of the (16, 8) weight: alike
    alike = {"emb": RowwiseParallel(), "head": ColwiseParallel()}
    assert tied_mismatches(stages, alike, tied, [2, 2]) == []
    # alike, but over other tp sizes, or across stage meshes (summed whole): found
    assert len(tied_mismatches(stages, alike, tied, [2, 1])) == 1
    assert len(tied_mismatches(stages, alike, tied, [2, 2], sharded_ok=False)) == 1
    assert tied_mismatches(stages, {}, tied, [2, 2], sharded_ok=False) == []


def test_holders_on_one_stage_are_compared_too() -> None:
    first, last = _stages()
    one = nn.Module()
    one.emb, one.head = first.emb, last.head
    assert find_tied([one]) == []
    within = shared_within([one])
    assert within == [{0: "emb.weight"}]
    bad = tied_mismatches([one], {"head": ColwiseParallel()}, within, [2])
    assert [how for _s, _p, how in bad[0][1]] == [
        "whole",
        "sharded on dim 0 over tp=2",
    ]


def test_layouts_of_the_styles_on_each_layer() -> None:
    lin, emb = nn.Linear(4, 6), nn.Embedding(6, 4)
    assert param_layout(lin, "weight", ColwiseParallel(), 2) == ("shard", 0, 2)
    assert param_layout(lin, "weight", RowwiseParallel(), 2) == ("shard", 1, 2)
    assert param_layout(lin, "bias", RowwiseParallel(), 2) == ("replicated",)
    assert param_layout(emb, "weight", ColwiseParallel(), 2) == ("shard", 1, 2)
    assert param_layout(emb, "weight", RowwiseParallel(), 2) == ("shard", 0, 2)
    assert param_layout(lin, "weight", ColwiseParallel(), 1) == ("replicated",)
