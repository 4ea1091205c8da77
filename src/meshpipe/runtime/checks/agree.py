"""Calls agree across pp ranks: a small fingerprint of every step, compared before any
transfer, so ranks that were given different work stop together with a message naming the
ranks and what differs, instead of computing a wrong number or waiting until a timeout.

The fingerprint is a few short texts (schedule, microbatch count, mode, the structure,
shapes and dtypes of inputs and target). Each rank sends one 8-byte digest per field over
the CPU-side group (one small all-gather); only when digests differ do the ranks exchange
the texts to say what differs. With ``check_inputs="values"`` (the default) the input
values are compared too, without reading them on the host (runtime/checks/values.py): the
fingerprint of the CPU leaves travels with the digests, that of the GPU leaves is gathered
on the device and read by the next call; ``"first_values"`` compares values on the first
call of each kind only.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from meshpipe.errors import CommTimeoutError, PipelineError
from meshpipe.runtime.checks.describe import (
    Described,
    call_key,
    describe_call,
    digests_of,
    schedule_digest,
)
from meshpipe.runtime.checks.values import (
    SLOTS,
    DeviceGather,
    Gathered,
    fingerprint,
    fingerprint_parts,
    verdict,
)
from meshpipe.runtime.failures.waits import wait_work
from meshpipe.runtime.mesh.layout import Layout
from meshpipe.runtime.step.pytree import flatten
from meshpipe.runtime.transfer.exchange import Ahead, Exchange, Routes, exchanges
from meshpipe.schedule.ir import Schedule

__all__ = [
    "CHECKS",
    "Agreement",
    "CallCheck",
    "CallSpec",
    "check_locally",
    "check_mode",
    "agree",
]

CHECKS = ("shapes", "values", "first_values", "off")
_WHAT = "the call check"
CPU = torch.device("cpu")


class CallSpec(NamedTuple):
    """A call as the pp ranks compare it: its name (``"step (grad_scale ...)"``,
    ``"eval_step"``, ``"forward"``), its schedule, and what it was given."""

    name: str
    schedule: Schedule
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any


class Agreement:
    """An agreement started without waiting: the digests (and ``values``, a CPU int64
    fingerprint, runtime/checks/values.py) are all-gathered in the background while the step
    begins; :meth:`check` waits (bounded) and raises PipelineError, on every rank alike, if
    the calls differ (``explain`` says how the gathered values differ, or None). The
    runtime checks before its first transfer."""

    def __init__(
        self,
        fields: dict[str, str],
        group: dist.ProcessGroup,
        size: int,
        timeout: float,
        rank: int,
        values: torch.Tensor | Sequence[torch.Tensor] | None = None,
        explain: Callable[[torch.Tensor], str | None] | None = None,
        digests: torch.Tensor | None = None,
        ahead: Ahead | None = None,
    ) -> None:
        self.fields = fields
        self._group, self._size, self._timeout, self._rank = group, size, timeout, rank
        self._explain = explain
        self._work: Any = None
        self._checked = size == 1
        if self._checked:
            return
        # ``digests``: digests_of(fields), kept by the caller (read here, never written)
        self._mine = digests_of(fields) if digests is None else digests
        self._num_digests = len(self._mine)
        if values is not None:  # int32 parts become int64 in the one concatenation
            parts = [values] if isinstance(values, torch.Tensor) else list(values)
            self._mine = torch.cat([self._mine, *parts])
        self._exchange: Exchange | None = None
        # ``ahead``: this exchange's receives were posted when the last one was done, and
        # the next one's are posted when this one is (a fixed-size exchange, CallCheck's)
        self._ahead = ahead
        if exchanges(group, self._mine):  # point to point (runtime/transfer/exchange.py)
            if ahead is None:
                self._exchange = Exchange(group, self._mine, _WHAT)
            else:
                posted = ahead.take(self._mine)
                self._exchange = Exchange(group, self._mine, _WHAT, ahead.tag, posted, ahead.routes)
            return
        self._every = [torch.empty_like(self._mine) for _ in range(size)]
        self._work = dist.all_gather(self._every, self._mine, group=group, async_op=True)

    def check(self) -> None:
        if self._checked:
            return
        self._checked = True
        others = [r for r in range(self._size) if r != self._rank]
        try:
            if self._exchange is not None:
                self._every = self._exchange.wait(self._timeout, _WHAT)
                if self._ahead is not None:
                    self._ahead.post(self._mine, _WHAT)
            else:
                name = f"pp rank {others[0]}" if len(others) == 1 else f"one of pp ranks {others}"
                wait_work(self._work, self._timeout, _WHAT, peer_name=name)
        except CommTimeoutError as e:
            raise CommTimeoutError(
                f"rank {self._rank} waited {self._timeout:.1f}s for pp rank(s) {others} to start "
                f"the same {self.fields.get('call', 'call')} (the call check, before any "
                "transfer); a rank that does not come is stuck, gone, or running other code",
                rank=self._rank,
                action="call check",
                peer=others[0] if len(others) == 1 else None,
            ) from e
        first = self._every[0]
        if all(torch.equal(t, first) for t in self._every[1:]):
            return
        n = self._num_digests
        if any(not torch.equal(t[:n], self._every[0][:n]) for t in self._every):
            texts: list[Any] = [None] * self._size
            dist.all_gather_object(texts, self.fields, group=self._group)
            raise PipelineError(_difference(texts))
        why = None if self._explain is None else self._explain(torch.stack(self._every)[:, n:])
        raise PipelineError(why or "the pp ranks' input values differ")


@functools.cache
def _no_values() -> torch.Tensor:
    """The values' part of a call check message without values (never written)."""
    return torch.zeros(2 * SLOTS, dtype=torch.int64)


def agree(
    fields: dict[str, str], group: dist.ProcessGroup, size: int, timeout: float, rank: int
) -> None:
    """Raise PipelineError on every rank of ``group`` unless all passed the same fields."""
    Agreement(fields, group, size, timeout, rank).check()


def _difference(texts: list[dict[str, str]]) -> str:
    order = ["pipeline", "call", "microbatches", "schedule", "mode", "inputs", "target"]
    keys = [k for k in order if any(k in t for t in texts)]
    for key in keys:
        seen = [t.get(key, "(not checked)") for t in texts]
        if len(set(seen)) > 1:
            ranks = ", ".join(f"rank {r} passed {v}" for r, v in enumerate(seen))
            if key == "pipeline":
                return (
                    f"the processes built their Pipeline differently: {ranks}. Every process "
                    "must build it with the same split_points, activation_checkpointing, dp "
                    "and chunk_spec "
                    "(a plan made on each process may differ from one to the next: make it "
                    "on one process and share it, as examples/plan.py does)"
                )
            return (
                f"the pp ranks were not given the same {key}: {ranks}. Every rank must make "
                "the same call with the same schedule, microbatch count, and inputs of the "
                "same structure and shapes"
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


def check_mode(check_inputs: str | None, mesh: object = None) -> str:
    """The call check a Pipeline runs: ``check_inputs``, by default "values" on every mesh
    (a process given other rows of the same shapes, e.g. by a sampler over every process
    instead of over the dp replicas, would otherwise train on them silently). The values
    are compared without a host read (runtime/checks/values.py), so the default is the same on CPU
    and CUDA, uniform meshes and stage meshes. ``mesh`` is not consulted any more."""
    if check_inputs is None:
        check_inputs = "values"
    if check_inputs not in CHECKS:
        raise PipelineError(f"check_inputs must be one of {CHECKS}, got {check_inputs!r}")
    return check_inputs


class CallCheck:
    """A Pipeline's call check: its mode, the schedules' digests, and the group over which
    the processes agree (every process of the pipeline, ``rank`` among ``size``; ``layout``
    names them). Values (modes "values", "first_values") are compared by fingerprints
    (runtime/checks/values.py): those of CPU leaves with the digests, at the gate; those of leaves
    on a CUDA ``device`` on the device over ``data`` (the pipeline's data group, the same
    processes), read by the next call, or at the gate by the first call of each kind.
    ``MESHPIPE_VALUES_ON_DEVICE=1`` (a testing aid) takes that path for CPU leaves too."""

    def __init__(
        self,
        mode: str,
        group: dist.ProcessGroup,
        size: int,
        rank: int,
        timeout: float,
        layout: Layout | None = None,
        data: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        routes: Routes | None = None,
        serial: int = 0,
    ) -> None:
        self.mode = mode
        self._group, self._size, self._rank, self._timeout = group, size, rank, timeout
        self._layout = layout if layout is not None else Layout.uniform(range(size), rank)
        # each schedule's digest by id, the schedule held with it (a freed schedule's id may
        # be reused by another one), the last few only
        self._digests: dict[int, tuple[Schedule, str]] = {}
        # the described fields and their digests per call_key and the rest they depend on
        self._described: dict[Hashable, Described] = {}
        self._values_seen: set[str] = set()  # kinds of call whose values were compared once
        device = device if device is not None else torch.device("cpu")
        aid = os.environ.get("MESHPIPE_VALUES_ON_DEVICE", "") == "1"
        values = mode in ("values", "first_values") and size > 1 and data is not None
        self._gather: DeviceGather | None = None
        if values and data is not None and (device.type == "cuda" or aid):
            self._gather = DeviceGather(data, size, device, timeout)
        self._pending: Gathered | None = None  # the last call's device values, unread
        # every call sends 3 + 2 * SLOTS int64 (describe.digests_of, then the values or
        # zeros), so the next call's receives are posted as soon as a call's check is done
        self._ahead = Ahead(group, routes, serial) if size > 1 else None
        # how this process built the Pipeline (runtime/pipeline/building.py: build_text),
        # compared with every call: processes that built it differently stop at the first
        self.build = ""

    def _name(self, proc: int) -> str:
        lay = self._layout
        if not lay.stage_meshes:
            return f"pp rank {proc} (global rank {lay.ranks[proc]})"
        pp, d, t = lay.place(proc)
        return f"global rank {lay.ranks[proc]} (pp rank {pp}, dp {d}, tp {t})"

    def _read(self, gathered: Gathered, late: bool) -> None:
        """Raise PipelineError (on every process alike) if the device values differ."""
        gather = self._gather
        if gather is None:  # only calls that launched a device gather get here
            raise RuntimeError("internal: device values read without a device gather")
        rows = gather.read(gathered)
        why = verdict(rows, gathered.paths, self._name, gathered.call)
        if why is not None:
            if late:
                why += (
                    " (found at the start of the next call: on the GPU a call's values are "
                    "compared on the device and read by the next call, so that no step waits "
                    "for the GPU)"
                )
            raise PipelineError(why)

    def _fingerprints(
        self, tensors: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The fingerprint of the leaves compared on the host (CPU), as parts to concatenate
        (values.fingerprint_parts), and of those gathered on the device (None without a
        device gather)."""
        gather = self._gather
        if gather is None:
            return fingerprint_parts(tensors, CPU), None
        here = [t.device.type != gather.device.type for t in tensors]
        host = fingerprint_parts([t if h else None for t, h in zip(tensors, here)], CPU)
        return host, fingerprint([None if h else t for t, h in zip(tensors, here)], gather.device)

    def _schedule_field(self, schedule: Schedule) -> str:
        held = self._digests.get(id(schedule))
        if held is None or held[0] is not schedule:
            if len(self._digests) >= 16:
                self._digests.clear()
            held = self._digests[id(schedule)] = (schedule, schedule_digest(schedule))
        return held[1]

    def _describe(
        self,
        spec: CallSpec,
        train_mode: bool,
    ) -> tuple[Described, list[torch.Tensor]]:
        """The call's fields, digests and leaf paths, kept per what they are a function of
        (the call, the schedule, the mode and ``call_key``): a call like an earlier one
        formats and hashes nothing. Its tensor leaves, in the paths' order."""
        call, schedule, args, kwargs, target = spec
        digest = self._schedule_field(schedule)
        structure, tensors = call_key(args, kwargs, target)
        key = (call, digest, schedule.name, schedule.num_microbatches, train_mode,
               torch.is_grad_enabled(), structure)  # fmt: skip
        got = self._described.get(key)
        if got is None:
            fields, leaves = describe_call(call, schedule, digest, args, kwargs, target, train_mode)
            if self.build:
                fields["pipeline"] = self.build
            got = Described(fields, digests_of(fields), tuple(p for p, _ in leaves))
            if len(self._described) >= 64:
                self._described.clear()
            self._described[key] = got
        return got, tensors

    def _agreement(
        self,
        spec: CallSpec,
        train_mode: bool,
        values: bool,
    ) -> tuple[Agreement, Gathered | None]:
        """Start the all-gather of the call's digests (with ``values``: and of the CPU
        leaves' fingerprint), and of the device leaves' fingerprint where there is a device
        gather."""
        described, tensors = self._describe(spec, train_mode)
        call = spec.name
        host: list[torch.Tensor] | None = None
        explain: Callable[[torch.Tensor], str | None] | None = None
        launched: Gathered | None = None
        if values and self._size > 1:
            paths = described.paths
            host, on_device = self._fingerprints(tensors)
            explain = functools.partial(verdict, paths=paths, name=self._name, call=call)
            if self._gather is not None and on_device is not None:
                launched = self._gather.launch(on_device, paths, call)
        if host is None:  # the same size with or without values (Ahead)
            host = [_no_values()]
        agreement = Agreement(
            described.fields, self._group, self._size, self._timeout, self._rank, host,
            explain, described.digests, self._ahead,
        )  # fmt: skip
        return agreement, launched

    def start(
        self,
        spec: CallSpec,
        train_mode: bool,
        training: bool,
        has_loss: bool,
    ) -> Callable[[], None]:
        """Start checking a call (the digests travel while the step begins); returns the
        *gate* that finishes the checks, identically on every process. The previous call's
        device values are read first: a difference raises PipelineError here."""
        call, _schedule, args, _kwargs, target = spec
        pending, self._pending = self._pending, None
        if pending is not None:
            self._read(pending, late=True)
        agreement: Agreement | None = None
        launched: Gathered | None = None
        kind = call.split(" ", 1)[0]  # "step", "eval_step", "forward"
        first = kind not in self._values_seen
        mode = self.mode
        if mode == "first_values":  # every process's state moves alike: same mode everywhere
            mode = "values" if first else "shapes"
        if mode != "off":
            agreement, launched = self._agreement(spec, train_mode, mode == "values")
        if launched is not None and not first:
            self._pending = launched  # read by the next call

        def gate() -> None:
            try:
                if agreement is not None:
                    agreement.check()
                if launched is not None and first:
                    self._read(launched, late=False)  # once per kind: waits for the device
                check_locally(args, target, training, has_loss)
            except PipelineError:  # refused on every process: this call's values are moot
                if self._pending is launched:
                    self._pending = None
                raise
            if mode == "values":
                self._values_seen.add(kind)

        return gate
