"""Context parallelism (issue 23, item 3): the cp axis splits each sequence into
load-balanced chunks, attention runs over the cp group, against one process after 3 AdamW
steps with clipping.

One spawn of 4 processes, sequence lengths 8, 16, 8:
  pp=2 x cp=2, HF Llama (sdpa, causal): parity (and eval_step); what each process saw (its
  chunk of the token ids, its local length); the cp bytes against the formula; a
  checkpoint saved there, loaded on pp=2 x dp=2 (fsdp, cp=1) and into the plain model in
  this process; the trace names each process's cp coordinate.
  pp=2 x cp=2, a custom model (its own sdpa calls, causal and full, learned positions from
  position_ids): parity with dp=None, "ddp", "fsdp" (sharded over the cp group); zbh1
  with the forward replayed in backward; fsdp with torch.utils.checkpoint; every other
  schedule (two stages per rank where it has them); pp=1 x dp=2 x cp=2, None and "fsdp";
  pp=1 x dp_replicate=2 x cp=2 with "hsdp"; stage meshes [{"cp": 2}, {"cp": 2}] with
  "ddp" and "fsdp".
  GPT-2 (tied weights) on pp=2 x cp=2; Llama with tp_plan="auto" on pp=1 x cp=2 x tp=2.
  bad input refused on every process: a length not divisible by 2 x cp, a model without
  attention, a padding mask, eager attention, forward(), a tensor without a
  sequence dim, cp_seq_dims of the wrong kind, cp ranks given different values or shapes,
  a sliding window (Mistral), labels= to a Hugging Face model, a model that changes the
  sequence length.
"""

from __future__ import annotations

import copy
import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshpipe
from meshpipe import checkpoint as ck
from meshpipe.testing import run_on_ranks

from parity import adamw_gaps, blocks, dp_batch, full, mse, refusal

pytestmark = pytest.mark.timeout(700)  # one spawn of 4 processes, run_on_ranks waits 600 s

ATOL = 1e-5
ROWS = 4
LENGTHS = (8, 16, 8)  # divisible by 2 x cp = 4
SCHEDULES = ("gpipe", "interleaved_1f1b", "looped_bfs", "zbv", "dualpipev")  # + 1f1b, zbh1
LOOPED = ("interleaved_1f1b", "looped_bfs", "zbv", "dualpipev")
VOCAB = 64


def _llama(attn: str = "sdpa") -> nn.Module:
    import split_models as sm

    sm.quiet_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _ce(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _tokens(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        x = torch.randint(0, VOCAB, (ROWS, n), generator=g)
        out.append((x, torch.randint(0, VOCAB, (ROWS, n), generator=g)))
    return out


def _chunk(t: torch.Tensor, rank: int, cp: int = 2) -> torch.Tensor:
    """cp rank ``rank``'s chunks of ``t`` on dim 1 (chunks rank and 2cp-1-rank of 2cp)."""
    parts = t.chunk(2 * cp, dim=1)
    return torch.cat((parts[rank], parts[2 * cp - 1 - rank]), dim=1)


def _train(
    pipe: meshpipe.Pipeline, ref: nn.Module, batches: Any, loss_fn: Any, mesh: Any = None
) -> dict[str, Any]:
    """3 AdamW steps with clipping on both; every process passes its replica's rows (the
    whole batch without a ``mesh`` to take them from), whole sequences. Also the largest
    gradient gap (before clipping) and each step's cp bytes."""
    grads = {"grad": 0.0}
    cp_bytes: list[Any] = []

    def compare_grads() -> None:
        cp_bytes.append(pipe.comm_stats().get("cp_bytes"))
        for name, p in pipe.named_parameters():
            assert p.grad is not None, name
            diff = (full(p.grad) - ref.get_parameter(name).grad).abs().max().item()
            grads["grad"] = max(grads["grad"], diff)

    rows = None if mesh is None else (lambda t: dp_batch(t, mesh))
    whole = [((x,), {}, y) for x, y in batches]
    gaps = adamw_gaps(pipe, ref, whole, loss_fn, part=rows, clip=0.5, after_backward=compare_grads)
    return {**gaps, **grads, "cp_bytes": cp_bytes}


def _seen(model: nn.Module) -> dict[str, list[Any]]:
    """Hooks recording what this process's modules were given: the token ids at the
    embedding, the sequence length at each attention."""
    seen: dict[str, list[Any]] = {"ids": [], "lengths": []}

    def ids(_m: nn.Module, a: tuple[Any, ...]) -> None:
        if type(a[0]) is torch.Tensor:  # not the fake tensors of the trace
            seen["ids"].append(a[0].detach().clone())

    def length(_m: nn.Module, _a: tuple[Any, ...], k: dict[str, Any]) -> None:
        if type(k["hidden_states"]) is torch.Tensor:
            seen["lengths"].append(int(k["hidden_states"].shape[1]))

    model.get_submodule("model.embed_tokens").register_forward_pre_hook(ids)
    for layer in model.get_submodule("model.layers"):
        layer.self_attn.register_forward_pre_hook(length, with_kwargs=True)
    return seen


def _llama_case(mesh: Any, root: str) -> dict[str, Any]:
    net = _llama()
    ref = copy.deepcopy(net)
    seen = _seen(net)
    batches = _tokens(5)
    pipe = meshpipe.Pipeline(
        net, mesh, "1f1b", 2, loss_fn=_ce, split_points=["model.layers.2"],
        example_args=(batches[0][0],),
    )  # fmt: skip
    out = _train(pipe, ref, batches, _ce)
    x, y = batches[1]
    with torch.no_grad():
        out["eval"] = abs(float(pipe.eval_step(x, target=y)) - _ce(ref(x), y).item())
    out["ids"] = seen["ids"]
    out["lengths"] = sorted(set(seen["lengths"]))
    out["layers"] = sum(1 for n, _ in pipe.named_parameters() if n.endswith("q_proj.weight"))
    ck.save(pipe, os.path.join(root, "llama_cp2"))
    out["state"] = {n: full(p) for n, p in pipe.named_parameters()}
    pipe.save_trace(os.path.join(root, "cp_trace.json"))
    # the cp=2 checkpoint into the same model on pp=2 x dp=2 (cp=1)
    pp_dp = meshpipe.init_mesh(pp=2, dp=2)
    other = meshpipe.Pipeline(
        _llama(), pp_dp, "1f1b", 2, loss_fn=_ce, split_points=["model.layers.2"],
        example_args=(batches[0][0],), dp="fsdp",
    )  # fmt: skip
    ck.load(other, os.path.join(root, "llama_cp2"))
    out["loaded"] = {n: full(p) for n, p in other.named_parameters()}
    return out


class Attn(nn.Module):
    """Multi-head attention through F.scaled_dot_product_attention (the cp interface)."""

    def __init__(self, d: int, causal: bool) -> None:
        super().__init__()
        # no bias: a key bias's gradient is 0 up to rounding, which AdamW scales up to lr
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)  # (b, h, s, dh)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.out(o.transpose(1, 2).reshape(b, s, d))


class Tiny(nn.Module):
    """Token and learned position embeddings, one full and three causal attention layers."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(32, d)
        self.layers = nn.ModuleList([Attn(d, causal=i > 0) for i in range(4)])
        self.head = nn.Linear(d, 8)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        h = self.emb(ids) + self.pos(position_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _custom_case(
    mesh: Any, dp: str | None, schedule: str = "1f1b", num_microbatches: int = 2, **kw: Any
) -> dict[str, Any]:
    torch.manual_seed(3)
    net = Tiny()
    ref = copy.deepcopy(net)
    # mse on 8 features: a cross entropy over rare tokens leaves head gradients near 0,
    # where AdamW turns rounding differences into steps of up to lr
    batches = [(x, torch.randn(*x.shape, 8, generator=torch.Generator().manual_seed(7)))
               for x, _ in _tokens(6)]  # fmt: skip
    if isinstance(mesh, list):  # stage meshes: every process passes the whole batch
        rows, points = 1, ["layers.2"]
    else:
        names = mesh.mesh_dim_names
        rows = mesh.size(names.index("dp")) * mesh.size(names.index("dp_replicate"))
        points = ["layers.2"] if mesh.size(0) == 2 and "stages_per_rank" not in kw else None
    pipe = meshpipe.Pipeline(
        net, mesh, schedule, num_microbatches, loss_fn=mse, dp=dp, split_points=points,
        example_args=(batches[0][0][: ROWS // rows],), **kw,
    )  # fmt: skip
    meshes = {
        (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape))
        for p in pipe.parameters()
        if hasattr(p, "device_mesh")
    }
    return {**_train(pipe, ref, batches, mse, mesh if rows > 1 else None), "meshes": meshes}


def _errors(mesh: Any) -> dict[str, str]:
    ids = torch.randint(0, VOCAB, (ROWS, 16), generator=torch.Generator().manual_seed(2))
    cp = mesh.get_local_rank("cp")

    def step(model: nn.Module, x: Any, y: Any, **kw: Any) -> Any:
        loss_fn = kw.pop("loss_fn", _ce)
        pipe = meshpipe.Pipeline(model, mesh, "1f1b", 2, loss_fn=loss_fn, **kw)
        return pipe.step(x, target=y)

    tiny = Tiny()
    x8 = torch.randn(ROWS, 8, 16)
    return {
        "length": refusal(lambda: step(Tiny(), ids[:, :6], ids[:, :6], split_points=["layers.2"])),
        "no_attention": refusal(lambda: step(blocks(4), x8, x8, loss_fn=mse)),
        "eager": refusal(lambda: step(_llama("eager"), ids, ids)),
        "forward": refusal(
            lambda: meshpipe.Pipeline(tiny, mesh, "1f1b", 2, split_points=["layers.2"])(ids)
        ),
        "no_seq_dim": refusal(lambda: step(Tiny(), ids, ids[:, 0], split_points=["layers.2"])),
        "seq_dims": refusal(lambda: step(Tiny(), ids, ids, cp_seq_dims={"target": 0})),
        "padding": refusal(lambda: _padded(mesh, ids)),
        "sliding": refusal(lambda: step(_mistral(), ids, ids)),
        "labels": refusal(lambda: _labels(mesh, ids)),
        "stage_cp": refusal(lambda: meshpipe.init_stage_meshes([{"cp": 2}, {"tp": 2}])),
        "values": refusal(lambda: step(Tiny(), (ids + cp) % VOCAB, ids, split_points=["layers.2"])),
        "shapes": refusal(lambda: step(Tiny(), ids[:, : 8 + 4 * cp], ids[:, : 8 + 4 * cp])),
    }


def _mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, sliding_window=4, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    return MistralForCausalLM(cfg)


class Prepend(Tiny):
    """A model that prepends two learned tokens: attention over S/cp + 2 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.zeros(1, 2, 16))

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(ids)
        h = torch.cat((self.first.expand(h.shape[0], 2, -1), h), dim=1)
        for layer in self.layers:
            h = layer(h)
        return self.head(h[:, 2:]).sum(-1)


def _length_change(mesh: Any) -> str:
    """The error of a step whose model changes the sequence length: raised by the stage
    that attends (pp rank 0), reported by the others (a failed step, not a refusal)."""
    pipe = meshpipe.Pipeline(Prepend(), mesh, "1f1b", 2, loss_fn=mse, split_points=["layers.2"])
    try:
        pipe.step(torch.zeros(ROWS, 16, dtype=torch.long), target=torch.zeros(ROWS, 16))
    except meshpipe.MeshpipeError as e:
        return str(e)
    return "accepted"


def _labels(mesh: Any, ids: torch.Tensor) -> Any:
    pipe = meshpipe.Pipeline(_llama(), mesh, "1f1b", 2, loss_fn=lambda out: out.loss)
    return pipe.step(ids, labels=ids)


def _padded(mesh: Any, ids: torch.Tensor) -> Any:
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    pipe = meshpipe.Pipeline(_llama(), mesh, "1f1b", 2, loss_fn=_ce)
    return pipe.step(ids, target=ids, attention_mask=mask)


def _world4(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2, cp=2)
    out: dict[str, Any] = {"coords": meshpipe.Pipeline(blocks(2), mesh, "1f1b", 2).topology.coords}
    out["llama"] = _llama_case(mesh, root)
    for dp in (None, "ddp", "fsdp"):
        out[f"custom_{dp}"] = _custom_case(mesh, dp)
    # the zero-bubble split of backward (I, W), with the forward replayed in backward
    out["custom_zbh1"] = _custom_case(mesh, None, "zbh1", activation_checkpointing="full")
    # torch.utils.checkpoint (FSDP2 stages): attention gathered again inside backward
    out["custom_ckpt"] = _custom_case(mesh, "fsdp", activation_checkpointing="full")
    for name in SCHEDULES:  # two stages per rank where the schedule has them
        per_rank = {"stages_per_rank": 2} if name in LOOPED else {}
        out[f"custom_schedule_{name}"] = _custom_case(mesh, None, name, 4, **per_rank)
    # rows over dp, sequences over cp: pp=1 x dp=2 x cp=2, FSDP2 over the 4 (dp x cp)
    dp_cp = meshpipe.init_mesh(pp=1, dp=2, cp=2)
    for dp in (None, "fsdp"):
        out[f"dp_cp_{dp}"] = _custom_case(dp_cp, dp)
    # stage meshes, cp=2 on each: each cp rank's slice of the pipeline, over the world group
    stage = meshpipe.init_stage_meshes([{"cp": 2}, {"cp": 2, "tp": 1}])
    for dp in ("ddp", "fsdp"):
        out[f"stage_{dp}"] = _custom_case(stage, dp)
    # hsdp: sharded within cp, replicated across dp_replicate (pp=1 x dp_replicate=2 x cp=2)
    out["hsdp_cp"] = _custom_case(meshpipe.init_mesh(pp=1, dp_replicate=2, cp=2), "hsdp")
    out["more"] = _more(mesh, dp_cp)
    out["errors"] = _errors(mesh)
    out["length_change"] = _length_change(mesh)  # last: a failed step
    return out


def _more(mesh: Any, dp_cp: Any) -> dict[str, Any]:
    """GPT-2 (tied embedding and head, learned positions) on pp=2 x cp=2; Llama with its
    tensor-parallel plan on pp=1 x cp=2 x tp=2."""
    import split_models as sm

    out: dict[str, Any] = {}
    batches = _tokens(5)
    torch.manual_seed(0)
    net = sm.gpt2(4)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", 2, loss_fn=_ce, example_args=(batches[0][0],))
    out["gpt2"] = _train(pipe, ref, batches, _ce)
    cp_tp = meshpipe.init_mesh(pp=1, cp=2, tp=2)
    net = _llama()
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(
        net, cp_tp, "1f1b", 2, loss_fn=_ce, example_args=(batches[0][0],), tp_plan="auto"
    )
    out["llama_tp"] = _train(pipe, ref, batches, _ce)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cp")


@cache
def _results(root: str) -> list[dict[str, Any]]:
    return run_on_ranks(_world4, 4, root, timeout=600.0)


@pytest.fixture(scope="module")
def world4(root: Path) -> list[dict[str, Any]]:
    return _results(str(root))


def test_coords_name_cp(world4: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(world4):
        assert r["coords"] == {"pp": rank // 2, "dp": 0, "cp": rank % 2, "tp": 0}, r["coords"]


def test_llama_pp2_cp2_matches_one_process(world4: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world4):
        r = res["llama"]
        assert r["loss"] < ATOL and r["norm"] < ATOL and r["param"] < ATOL, (rank, r)
        assert r["grad"] < ATOL and r["eval"] < ATOL, (rank, r)


def test_each_process_computed_only_its_chunk(world4: list[dict[str, Any]]) -> None:
    batches = _tokens(5)
    for rank, res in enumerate(world4):
        r = res["llama"]
        cp = rank % 2
        # the attention layers of this process saw half of each sequence: 4 and 8 tokens
        assert r["lengths"] == [n // 2 for n in sorted(set(LENGTHS))], (rank, r["lengths"])
        if rank < 2:  # pp rank 0 embeds: its token ids are exactly its two chunks
            want = [_chunk(x, cp) for x, _ in batches]
            got = [torch.cat(r["ids"][2 * i : 2 * i + 2]) for i in range(len(batches))]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), rank


def test_cp_bytes_match_the_formula(world4: list[dict[str, Any]]) -> None:
    # per attention call: (cp-1) x the local K and V bytes in the all-gather, as much again
    # in its backward; K and V: rows x 2 kv heads x local length x head dim 8, fp32
    for rank, res in enumerate(world4):
        r = res["llama"]
        assert r["layers"] == 2
        want = [2 * 2 * 1 * 2 * ROWS * 2 * (n // 2) * 8 * 4 for n in LENGTHS]
        assert r["cp_bytes"] == want, (rank, r["cp_bytes"], want)


@pytest.mark.parametrize("dp", ["None", "ddp", "fsdp"])
def test_custom_attention_pp2_cp2_matches_one_process(
    world4: list[dict[str, Any]], dp: str
) -> None:
    for rank, res in enumerate(world4):
        r = res[f"custom_{dp}"]
        assert r["loss"] < ATOL and r["norm"] < ATOL and r["grad"] < ATOL, (rank, dp, r)
        # fsdp shards over the cp group (the data-parallel group of a pp=2 x cp=2 mesh)
        assert r["meshes"] == ({(("cp",), (2,))} if dp == "fsdp" else set()), r["meshes"]
        # one weight (layers.0.out.weight[6, 6]) has a first gradient of -1.8e-7 against a
        # mean of 1e-2: AdamW's first step, g / (|g| + 1e-8), turns the rounding of that
        # gradient (1e-8, the order of the sums) into a 2e-5 gap; every other weight is
        # within 3e-6
        assert r["param"] < 1e-4, (rank, dp, r)


@pytest.mark.parametrize(
    "case", ["zbh1", "ckpt", "dp_cp_None", "dp_cp_fsdp", "hsdp_cp", "stage_ddp", "stage_fsdp"]
)
def test_zero_bubble_checkpointing_and_dp_by_cp_match_one_process(
    world4: list[dict[str, Any]], case: str
) -> None:
    key = f"custom_{case}" if case in ("zbh1", "ckpt") else case
    for rank, res in enumerate(world4):
        r = res[key]
        assert r["loss"] < ATOL and r["norm"] < ATOL and r["grad"] < ATOL, (rank, case, r)
        assert r["param"] < 1e-4, (rank, case, r)  # see the test above
        if case == "dp_cp_fsdp":  # sharded over dp x cp, flattened
            assert r["meshes"] == {(("dp_cp",), (4,))}, r["meshes"]
        if case == "hsdp_cp":  # replicated across dp_replicate, sharded over cp
            assert r["meshes"] == {(("dp_replicate", "cp"), (2, 2))}, r["meshes"]
        if case == "stage_fsdp":  # each stage mesh's parameters sharded over its cp ranks
            assert r["meshes"] == {(("cp",), (2,))}, r["meshes"]
        if case.startswith(("dp_cp", "hsdp")):  # two rows of each chunk, 1 stage: 4 layers
            assert r["cp_bytes"] == [4 * 2 * 1 * 2 * 2 * 2 * (n // 2) * 8 * 4 for n in LENGTHS]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_matches_one_process(world4: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(world4):
        r = res[f"custom_schedule_{name}"]
        assert r["loss"] < ATOL and r["norm"] < ATOL and r["grad"] < ATOL, (rank, name, r)
        assert r["param"] < 1e-4, (rank, name, r)  # see the custom model's test


@pytest.mark.parametrize("case", ["gpt2", "llama_tp"])
def test_gpt2_and_tensor_parallel_llama_match_one_process(
    world4: list[dict[str, Any]], case: str
) -> None:
    for rank, res in enumerate(world4):
        r = res["more"][case]
        assert r["loss"] < ATOL and r["norm"] < ATOL and r["grad"] < ATOL, (rank, case, r)
        # cross entropy over 64 tokens: AdamW scales the rounding of near-0 head gradients
        assert r["param"] < 1e-4, (rank, case, r)


def test_bad_input_is_refused_on_every_process(world4: list[dict[str, Any]]) -> None:
    errors = world4[0]["errors"]
    assert all(r["errors"] == errors for r in world4)
    assert "length 6 is not divisible by 4" in errors["length"], errors["length"]
    assert (
        "no stage ran torch.nn.functional.scaled_dot_product_attention" in errors["no_attention"]
    ), errors["no_attention"]
    assert "attn_implementation='eager'" in errors["eager"], errors["eager"]
    assert "forward() with context parallelism (cp=2) is not built" in errors["forward"]
    assert "'target'" in errors["no_seq_dim"] and "shape [4]" in errors["no_seq_dim"]
    assert "cp_seq_dims['target'] = 0" in errors["seq_dims"], errors["seq_dims"]
    assert "attention_mask has zeros" in errors["padding"], errors["padding"]
    assert "same rows, whole sequences, but their inputs' values differ" in errors["values"]
    assert "MistralAttention has sliding_window=4" in errors["sliding"], errors["sliding"]
    assert (
        "have cp sizes [2, 1]; context parallelism on stage meshes needs the same cp"
        in (errors["stage_cp"])
    ), errors["stage_cp"]
    assert "a Hugging Face model's own loss (labels=)" in errors["labels"], errors["labels"]
    for r in world4:
        assert (
            "attention over 10 tokens, but this process's chunks of the inputs have [8]"
            in (r["length_change"])
        ), r["length_change"]
    assert "inputs' shapes or structure differ" in errors["shapes"], errors["shapes"]


def test_cp2_checkpoint_loads_on_pp2_dp2_fsdp(world4: list[dict[str, Any]]) -> None:
    saved: dict[str, torch.Tensor] = {}
    for r in world4:
        saved.update(r["llama"]["state"])
    for r in world4:
        loaded = r["llama"]["loaded"]
        assert loaded and all(torch.equal(t, saved[n]) for n, t in loaded.items())


def test_trace_names_each_process_cp_coordinate(world4: list[dict[str, Any]], root: Path) -> None:
    text = (root / "cp_trace.json").read_text()
    for rank in range(4):
        where = f"process {rank} (pp {rank // 2}, dp 0, cp {rank % 2}, tp 0)"
        assert where in text, where


def test_cp2_checkpoint_loads_in_one_process(world4: list[dict[str, Any]], root: Path) -> None:
    plain = _llama()
    ck.load(plain, root / "llama_cp2")
    saved: dict[str, torch.Tensor] = {}
    for r in world4:
        saved.update(r["llama"]["state"])
    assert sorted(saved) == sorted(n for n, _ in plain.named_parameters())
    for name, t in saved.items():
        assert torch.equal(plain.get_parameter(name).detach(), t), name


def test_simulator_counts_cp_processes_of_stage_meshes() -> None:
    from meshpipe.sim.meshes import mesh_processes, stage_mesh_cost

    assert mesh_processes([{"cp": 2}, {"dp": 2, "cp": 2}]) == (2, 4)
    sched = meshpipe.get_schedule("1f1b", num_ranks=2, num_microbatches=2)
    cost = stage_mesh_cost(meshpipe.Cost(f=1.0, b=2.0), sched, [{"cp": 2}, {"dp": 2, "cp": 2}])
    assert cost.f == (0.5, 0.25) and cost.b == (1.0, 0.5)


def test_a_window_of_zero_is_no_window() -> None:
    """Qwen2-MoE's config says sliding_window=0 when use_sliding_window is off: full causal
    attention, built for cp (it was refused as a window); a window that is on is refused."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from meshpipe.parallel.cp import _check_hf

    small = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=32,
    )  # fmt: skip
    full = Qwen2MoeForCausalLM(Qwen2MoeConfig(**small))
    assert full.config.sliding_window == 0
    for layer in full.model.layers:
        _check_hf(layer.self_attn, 2)  # no error
    windowed = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(**small, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    )
    with pytest.raises(meshpipe.PipelineError, match="sliding_window=4"):
        for layer in windowed.model.layers:
            _check_hf(layer.self_attn, 2)
