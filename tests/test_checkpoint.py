"""meshpipe.checkpoint in one process (plain nn.Module targets): state, checks, safety, extra.

The multi-process layouts are in test_checkpoint_layouts.py, the killed save in
test_checkpoint_kill.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from meshpipe import checkpoint as ck


def net(seed: int = 0, out: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, out))


def two_groups(model: nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.8, 0.9),
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_roundtrip_model_adamw_groups_and_extra(tmp_path: Path) -> None:
    src = net(0)
    opt = two_groups(src)
    train(src, opt)
    extra = {
        "step": 2,
        "pos": (3, [1, 2]),
        "nested": {"x": None, "ok": True, "f": 0.5},
        "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "ints": torch.tensor([1, -2], dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
    }
    ck.save(src, tmp_path / "c", optimizer=opt, extra=extra)
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no staging directory left behind

    dst = net(1)
    dst_opt = two_groups(dst, lr=1.0)
    got = ck.load(dst, tmp_path / "c", optimizer=dst_opt)
    assert same_state(src, dst)
    a, b = opt.state_dict(), dst_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]  # lr, betas (a tuple), weight decay
    for i, state in a["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["state"][i][k]), (i, k)
    assert got["step"] == 2 and got["pos"] == (3, [1, 2]) and got["nested"] == extra["nested"]
    for k in ("t", "ints", "mask", "empty"):
        assert got[k].dtype == extra[k].dtype and torch.equal(got[k], extra[k]), k
    # the continued runs are the same, bitwise
    torch.manual_seed(9)
    train(src, opt)
    torch.manual_seed(9)
    train(dst, dst_opt)
    assert same_state(src, dst)


def test_rng_state_restores_the_streams(tmp_path: Path) -> None:
    import random

    model = net()
    torch.manual_seed(3)
    random.seed(3)
    ck.save(model, tmp_path / "c", extra={"rng": ck.rng_state()})
    expected = (torch.rand(4), random.random())
    torch.manual_seed(77)
    random.seed(77)
    ck.set_rng_state(ck.load(model, tmp_path / "c")["rng"])
    got = (torch.rand(4), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_empty_optimizer_state_and_wrong_optimizer(tmp_path: Path) -> None:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # no step yet: no state
    ck.save(model, tmp_path / "c", optimizer=opt)
    fresh = net(1)
    other = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    ck.load(fresh, tmp_path / "c", optimizer=other)
    assert other.param_groups[0]["lr"] == 0.5 and not other.state
    with pytest.raises(ck.CheckpointError, match="holds AdamW state but the optimizer is a SGD"):
        ck.load(fresh, tmp_path / "c", optimizer=torch.optim.SGD(fresh.parameters(), lr=1.0))
    ck.save(model, tmp_path / "no_optim")
    with pytest.raises(ck.CheckpointError, match="holds no optimizer state"):
        ck.load(fresh, tmp_path / "no_optim", optimizer=other)


def test_regrouped_parameters_with_different_hyperparameters_are_refused(tmp_path: Path) -> None:
    src = net()
    ck.save(src, tmp_path / "c", optimizer=two_groups(src))
    dst = net()
    with pytest.raises(ck.CheckpointError, match="different hyperparameters"):
        ck.load(dst, tmp_path / "c", optimizer=torch.optim.AdamW(dst.parameters()))


def test_foreign_parameter_in_optimizer_is_named(tmp_path: Path) -> None:
    model = net()
    stray = nn.Parameter(torch.zeros(5, 7))
    opt = torch.optim.AdamW([*model.parameters(), stray])
    with pytest.raises(ck.CheckpointError, match=r"\(5, 7\)"):
        ck.save(model, tmp_path / "c", optimizer=opt)
    assert not (tmp_path / "c").exists()


def test_missing_unexpected_and_mismatched_keys_are_named(tmp_path: Path) -> None:
    ck.save(net(), tmp_path / "c")
    wider = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(ck.CheckpointError) as info:
        ck.load(wider, tmp_path / "c")
    err = info.value
    assert err.missing == ["3.bias", "3.weight"]
    assert err.unexpected == []
    assert err.mismatched == [("2.bias", (2,), (3,)), ("2.weight", (2, 8), (3, 8))]
    assert "3.weight" in str(err) and "2.weight" in str(err)
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())  # untouched

    shorter = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(ck.CheckpointError) as info:
        ck.load(shorter, tmp_path / "c")
    assert info.value.unexpected == ["1.bias", "1.weight", "2.bias", "2.weight"]
    ck.load(shorter, tmp_path / "c", strict=False)  # the keys that match are loaded
    assert torch.equal(shorter[0].weight, net()[0].weight)


def test_extra_must_be_json_or_tensors(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match=r"extra\['bad'\] is a object"):
        ck.save(net(), tmp_path / "c", extra={"bad": object()})
    with pytest.raises(ck.CheckpointError, match="keys must be str"):
        ck.save(net(), tmp_path / "c", extra={1: 2})  # type: ignore[dict-item]
    assert not (tmp_path / "c").exists()


class Planted:
    """Unpickling this runs code: it creates a file (stands in for anything worse)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def drop_checksums(directory: Path) -> None:
    """Remove the record's checksums, as an attacker who rewrites the record could."""
    record = json.loads((directory / "meshpipe.json").read_text())
    del record["checksums"]
    (directory / "meshpipe.json").write_text(json.dumps(record))


def test_planted_metadata_is_not_unpickled(tmp_path: Path) -> None:
    import pickle

    ck.save(net(), tmp_path / "c")
    marker = tmp_path / "pwned"
    with open(tmp_path / "c" / ".metadata", "wb") as f:
        pickle.dump(Planted(marker), f)
    with pytest.raises(ck.CheckpointError, match=r"\.metadata: \d+ bytes, expected"):
        ck.load(net(), tmp_path / "c")  # the recorded checksum refuses it first
    drop_checksums(tmp_path / "c")  # the restricted unpickler does not rely on the record
    with pytest.raises(ck.CheckpointError, match="refusing to unpickle"):
        ck.load(net(), tmp_path / "c", verify=False)
    assert not marker.exists()


def test_planted_bytes_item_is_not_unpickled(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    ck.save(net(), tmp_path / "good")
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil"
    state: dict[str, object] = {f"model.{k}": v for k, v in net().state_dict().items()}
    state["model.0.weight"] = Planted(marker)  # DCP pickles non-tensor values
    dcp_save(state, checkpoint_id=str(evil), no_dist=True)
    shutil.copy(tmp_path / "good" / "meshpipe.json", evil / "meshpipe.json")
    drop_checksums(evil)  # the checksums are good's, not evil's
    with pytest.raises(ck.CheckpointError, match="'model.0.weight' holds pickled bytes"):
        ck.load(net(), evil, verify=False)
    assert not marker.exists()


def test_incomplete_or_foreign_directories(tmp_path: Path) -> None:
    ck.save(net(), tmp_path / "c")
    os.remove(tmp_path / "c" / "meshpipe.json")
    with pytest.raises(ck.CheckpointError, match="not a complete meshpipe checkpoint"):
        ck.load(net(), tmp_path / "c")
    with pytest.raises(ck.CheckpointError, match="no checkpoint at"):
        ck.load(net(), tmp_path / "nothing")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ck.CheckpointError, match="refusing to replace it"):
        ck.save(net(), foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ck.CheckpointError, match="is a file"):
        ck.save(net(), tmp_path / "file")
    ck.save(net(), tmp_path / "c2")
    record = json.loads((tmp_path / "c2" / "meshpipe.json").read_text())
    record["version"] = 99
    (tmp_path / "c2" / "meshpipe.json").write_text(json.dumps(record))
    with pytest.raises(ck.CheckpointError, match="format version 99"):
        ck.load(net(), tmp_path / "c2")


def test_crash_between_the_two_renames_is_recovered(tmp_path: Path) -> None:
    old = net(0)
    ck.save(old, tmp_path / "c")
    # what a save killed after moving the old checkpoint aside leaves behind
    os.rename(tmp_path / "c", tmp_path / ".c.old-deadbeef")
    (tmp_path / ".c.tmp-deadbeef").mkdir()  # and its half-written successor
    got = net(5)
    with pytest.raises(ck.CheckpointError, match=r"found \[.*\.c\.old-deadbeef'\].*allow_fallback"):
        ck.load(got, tmp_path / "c")  # anyone may have planted it: named, not loaded
    assert same_state(got, net(5))
    ck.load(got, tmp_path / "c", allow_fallback=True)
    assert same_state(got, old)
    new = net(1)
    ck.save(new, tmp_path / "c")  # puts the old one back first, then replaces it
    assert sorted(os.listdir(tmp_path)) == ["c"]
    ck.load(got, tmp_path / "c")
    assert same_state(got, new)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(2.0))


def test_export_tied_weights_and_load_export(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    ck.export(model, tmp_path / "m.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
    tensors = load_file(tmp_path / "m.safetensors")
    assert sorted(tensors) == ["embed.weight", "head.weight", "scale"]
    plain = Tied()
    plain.load_state_dict(tensors)
    assert same_state(plain, model)
    back = Tied()
    ck.load_export(back, tmp_path / "m.safetensors")
    assert same_state(back, model)
    with pytest.raises(ck.CheckpointError) as info:
        ck.load_export(net(), tmp_path / "m.safetensors")
    assert info.value.unexpected == ["embed.weight", "head.weight", "scale"]
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ck.CheckpointError, match="cannot be read as safetensors"):
        ck.load_export(net(), tmp_path / "junk.safetensors")


def test_wrong_target_type(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match="expected a meshpipe.Pipeline or an nn.Module"):
        ck.save({"w": torch.zeros(1)}, tmp_path / "c")


def test_demo_passes_save_and_resume_to_its_ranks() -> None:
    import argparse

    from meshpipe.demo.options import add_demo_args, resolve, to_argv

    parser = argparse.ArgumentParser()
    add_demo_args(parser)
    opts = resolve(parser.parse_args(["--ranks", "2", "--save", "a", "--resume", "b"]))
    assert (opts.save, opts.resume) == ("a", "b")
    assert resolve(parser.parse_args(to_argv(opts))) == opts
    plain = resolve(parser.parse_args([]))
    assert plain.save is None and "--save" not in to_argv(plain)
