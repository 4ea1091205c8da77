"""Calls agree across pp ranks: a small fingerprint of every step, compared before any
transfer, so ranks that were given different work stop together with a message naming the
ranks and what differs, instead of computing a wrong number or waiting until a timeout.

The fingerprint is a few short texts (schedule, microbatch count, mode, the structure,
shapes and dtypes of inputs and target; with ``check_inputs="values"`` also a hash of every
input tensor's bytes, read on the host; with ``"first_values"`` that hash on the first call
of each kind only, so later steps on a GPU read nothing). Each rank sends one 8-byte digest
per field over the CPU-side group (one small all-gather); only when digests differ do the
ranks exchange the texts to say what differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.errors import CommTimeoutError, PipelineError
from meshpipe.runtime.pytree import flatten
from meshpipe.runtime.stage_meshes import is_stage_meshes
from meshpipe.runtime.waits import wait_work
from meshpipe.schedule.ir import Schedule

__all__ = [
    "CHECKS",
    "Agreement",
    "CallCheck",
    "check_locally",
    "check_mode",
    "fingerprint",
    "agree",
    "schedule_digest",
]

CHECKS = ("shapes", "values", "first_values", "off")


def _describe(value: Any, path: str, out: list[str], values: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        out.append(f"{path} of shape {tuple(value.shape)} ({dtype})")
        values.append(value)
    elif isinstance(value, (tuple, list)):
        out.append(f"{path}: {type(value).__name__} of {len(value)}")
        for i, v in enumerate(value):
            _describe(v, f"{path}[{i}]", out, values)
    elif isinstance(value, Mapping):
        out.append(f"{path}: keys {sorted(map(str, value))}")
        for k, v in value.items():
            _describe(v, f"{path}[{k!r}]", out, values)
    elif isinstance(value, (type(None), bool, int, float, str)):
        out.append(f"{path} = {value!r}")
    else:
        out.append(f"{path}: {type(value).__qualname__}")


def _values_hash(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        data = t.detach().contiguous().cpu()  # a host read: only with check_inputs="values"
        h.update(data.view(torch.uint8).reshape(-1).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def fingerprint(
    call: str,
    schedule: Schedule,
    schedule_digest: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    target: Any,
    training: bool,
    check: str,
) -> dict[str, str]:
    """The fields every pp rank must agree on for one call (``call``: "step", "forward"...)."""
    parts: list[str] = []
    tensors: list[torch.Tensor] = []
    for i, a in enumerate(args):
        _describe(a, f"argument {i}", parts, tensors)
    for k, v in kwargs.items():
        _describe(v, f"argument {k!r}", parts, tensors)
    target_parts: list[str] = []
    _describe(target, "target", target_parts, tensors)
    fields = {
        "call": call,
        "schedule": f"{schedule.name} (actions {schedule_digest})",
        "microbatches": str(schedule.num_microbatches),
        "mode": ("train" if training else "eval")
        + (", gradients on" if torch.is_grad_enabled() else ", gradients off"),
        "inputs": "; ".join(parts),
        "target": "; ".join(target_parts),
    }
    if check == "values":
        fields["values"] = _values_hash(tensors)
    return fields


def schedule_digest(schedule: Schedule) -> str:
    return hashlib.blake2b(schedule.to_text().encode(), digest_size=6).hexdigest()


class Agreement:
    """An agreement started without waiting: the digests are all-gathered in the background
    while the step begins; :meth:`check` waits (bounded) and raises PipelineError, on every
    rank alike, if the calls differ. The runtime checks before its first transfer."""

    def __init__(
        self, fields: dict[str, str], group: dist.ProcessGroup, size: int, timeout: float, rank: int
    ) -> None:
        self.fields = fields
        self._group, self._size, self._timeout, self._rank = group, size, timeout, rank
        self._work: Any = None
        self._checked = size == 1
        if self._checked:
            return
        names = sorted(fields)
        digests = [
            int.from_bytes(hashlib.blake2b(fields[n].encode(), digest_size=7).digest(), "big")
            for n in names
        ]
        self._mine = torch.tensor([*digests, len(names)], dtype=torch.int64)
        self._every = [torch.empty_like(self._mine) for _ in range(size)]
        self._work = dist.all_gather(self._every, self._mine, group=group, async_op=True)

    def check(self) -> None:
        if self._checked:
            return
        self._checked = True
        others = [r for r in range(self._size) if r != self._rank]
        try:
            name = f"pp rank {others[0]}" if len(others) == 1 else f"one of pp ranks {others}"
            wait_work(self._work, self._timeout, "the call check", peer_name=name)
        except CommTimeoutError as e:
            raise CommTimeoutError(
                f"rank {self._rank} waited {self._timeout:.1f}s for pp rank(s) {others} to start "
                f"the same {self.fields.get('call', 'call')} (the call check, before any "
                "transfer); a rank that does not come is stuck, gone, or running other code",
                rank=self._rank,
                action="call check",
                peer=others[0] if len(others) == 1 else None,
            ) from e
        if all(torch.equal(t, self._every[0]) for t in self._every):
            return
        texts: list[Any] = [None] * self._size
        dist.all_gather_object(texts, self.fields, group=self._group)
        raise PipelineError(_difference(texts))


def agree(
    fields: dict[str, str], group: dist.ProcessGroup, size: int, timeout: float, rank: int
) -> None:
    """Raise PipelineError on every rank of ``group`` unless all passed the same fields."""
    Agreement(fields, group, size, timeout, rank).check()


def _difference(texts: list[dict[str, str]]) -> str:
    order = ["call", "microbatches", "schedule", "mode", "inputs", "target", "values"]
    keys = [k for k in order if any(k in t for t in texts)]
    for key in keys:
        seen = [t.get(key, "(not checked)") for t in texts]
        if len(set(seen)) > 1:
            ranks = ", ".join(f"rank {r} passed {v}" for r, v in enumerate(seen))
            return (
                f"the pp ranks were not given the same {key}: {ranks}. Every rank must make "
                "the same call with the same schedule, microbatch count, and inputs of the "
                "same structure and shapes"
                + (" and values (check_inputs='values')" if key == "values" else "")
            )
    return "the pp ranks' calls differ"


def check_locally(args: tuple[Any, ...], target: Any, training: bool, has_loss: bool) -> None:
    """The checks of a call that need no other rank (the same verdict everywhere, since
    every rank makes the same call)."""
    if training and (torch.is_inference_mode_enabled() or not torch.is_grad_enabled()):
        raise PipelineError(
            "step() was called under torch.no_grad() or torch.inference_mode(): it trains, "
            "so it needs gradients; call it outside, or use forward() for inference"
        )
    if training and not has_loss:
        raise PipelineError("step() needs a loss_fn: pass loss_fn= to Pipeline")
    if target is not None:
        leaves, _ = flatten(target)
        if not leaves:
            raise PipelineError(
                f"target must be a tensor (or a pytree of tensors), got {type(target).__name__}"
            )
    if not args:
        raise PipelineError("step()/forward() need at least one positional input")


def check_mode(check_inputs: str | None, mesh: object) -> str:
    """The call check a Pipeline runs: ``check_inputs``, or by default "shapes". With stage
    meshes every process must pass the whole batch (a process passing its own slice, the
    uniform mesh's habit, would otherwise train on the wrong rows), so the default compares
    values: on every call on CPU ("values"), on the first call of each kind on CUDA
    ("first_values": reading the inputs on the host is a synchronisation; a loop that passes
    slices does so from its first step)."""
    if check_inputs is None:
        if not is_stage_meshes(mesh):
            check_inputs = "shapes"
        else:
            cuda = getattr(mesh[0], "device_type", "cpu") == "cuda"  # type: ignore[index]
            check_inputs = "first_values" if cuda else "values"
    if check_inputs not in CHECKS:
        raise PipelineError(f"check_inputs must be one of {CHECKS}, got {check_inputs!r}")
    return check_inputs


class CallCheck:
    """A Pipeline's call check: its mode, the schedules' digests, and the group over which
    the processes agree (every process of the pipeline, ``rank`` among ``size``)."""

    def __init__(
        self, mode: str, group: dist.ProcessGroup, size: int, rank: int, timeout: float
    ) -> None:
        self.mode = mode
        self._group, self._size, self._rank, self._timeout = group, size, rank, timeout
        self._digests: dict[int, str] = {}
        self._values_seen: set[str] = set()  # "first_values": kinds of call already compared

    def start(
        self,
        call: str,
        schedule: Schedule,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        train_mode: bool,
        training: bool,
        has_loss: bool,
    ) -> Callable[[], None]:
        """Start checking a call (the digests travel while the step begins); returns the
        *gate* that finishes the checks, identically on every process."""
        agreement: Agreement | None = None
        kind = call.split(" ", 1)[0]  # "step", "eval_step", "forward"
        mode = self.mode
        if mode == "first_values":  # every process's state moves alike: same mode everywhere
            mode = "shapes" if kind in self._values_seen else "values"
        if mode != "off":
            digest = self._digests.get(id(schedule))
            if digest is None:
                digest = self._digests[id(schedule)] = schedule_digest(schedule)
            fields = fingerprint(call, schedule, digest, args, kwargs, target, train_mode, mode)
            agreement = Agreement(fields, self._group, self._size, self._timeout, self._rank)

        def gate() -> None:
            if agreement is not None:
                agreement.check()
                if mode == "values" and self.mode == "first_values":
                    self._values_seen.add(kind)
            check_locally(args, target, training, has_loss)

        return gate
