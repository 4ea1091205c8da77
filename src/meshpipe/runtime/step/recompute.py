"""Activation checkpointing per stage or per block, applied after the split, keeping names.

A list gives one policy per stage (``["full", None]``: only stage 0 recomputes).
``"full"`` recomputes each stage's forward in its backward (only the stage inputs are kept
between F and B/I). A callable ``(qualified_name, module) -> bool`` picks submodules of
the stage whose forward is recomputed instead (e.g. every transformer block, also on
traced stages, which call their blocks as modules); their parameter names do not change
(the module's forward is wrapped, the module is not replaced).

A forward run again for its activations is not a second forward: buffers it updates
(batch norm's running statistics, a counter) are put back as they were before the
recomputation (:class:`KeptBuffers`), so they end each step as in one process without
checkpointing (before 2026-12-02 a replayed stage's counter read 8 after 4 microbatches).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from meshpipe.errors import PipelineError
from meshpipe.schedule.ir import Op

__all__ = [
    "Policy", "check_policy", "stage_policy", "apply_policy", "backward_plan", "Replay",
    "keeping_nothing", "replays", "KeptBuffers", "recomputing",
]  # fmt: skip

Policy = str | Callable[[str, nn.Module], bool] | None


def check_policy(policy: Any, num_stages: int | None = None) -> None:
    """None, "full", a callable, or (with ``num_stages``) a list of one of those per stage."""
    if isinstance(policy, list | tuple):
        if num_stages is not None and len(policy) != num_stages:
            raise PipelineError(
                f"activation_checkpointing has {len(policy)} entries but there are "
                f"{num_stages} stages; give one per stage"
            )
        for p in policy:
            if isinstance(p, list | tuple):
                raise PipelineError(f"activation_checkpointing entries cannot nest: {p!r}")
            check_policy(p)
        return
    if policy is None or policy == "full" or callable(policy):
        return
    raise PipelineError(
        f"activation_checkpointing must be None, 'full', a callable "
        f"(qualified_name, module) -> bool, or a list of those per stage, got {policy!r}"
    )


def stage_policy(policy: Any, stage: int) -> Policy:
    """The policy of one stage (a per-stage list's entry)."""
    if isinstance(policy, list | tuple):
        return policy[stage]  # type: ignore[no-any-return]
    return policy  # type: ignore[no-any-return]


def _checkpointed(module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    context = partial(recomputing, module)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


# per module: the names of the buffers its forward updates, learned at its first
# recomputation (every buffer is kept then; only those afterwards)
_updated: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()


class KeptBuffers:
    """Puts ``module``'s buffers that a recomputation changed back as they were before it.
    The first recomputation of a module keeps a copy of every buffer and learns which ones
    its forward updates; later ones copy only those."""

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module
        self.saved: list[tuple[str, torch.Tensor, int, torch.Tensor]] = []

    def __enter__(self) -> None:
        if self.module is None:
            return
        names = _updated.get(self.module)
        buffers = self.module.named_buffers()
        with torch.no_grad():
            self.saved = [
                (n, b, b._version, b.detach().clone())
                for n, b in buffers
                if names is None or n in names
            ]

    def __exit__(self, *exc: object) -> None:
        if self.module is None:
            return
        changed = []
        with torch.no_grad():
            for name, buf, version, old in self.saved:
                if buf._version != version:
                    buf.copy_(old)
                    changed.append(name)
        if self.module not in _updated:
            _updated[self.module] = changed
        self.saved = []


class _Modes:
    """Enters the torch function modes a forward ran under that are not active now."""

    def __init__(self, modes: list[Any]) -> None:
        self.modes = modes
        self.entered: list[Any] = []

    def __enter__(self) -> None:
        active = _mode_stack()
        self.entered = [m for m in self.modes if not any(m is a for a in active)]
        for m in self.entered:
            m.__enter__()

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self.entered):
            m.__exit__(None, None, None)
        self.entered = []


def same_modes() -> tuple[contextlib.AbstractContextManager[None], _Modes]:
    """torch.utils.checkpoint's ``context_fn``: the recomputation runs under the torch
    function modes of the forward (context parallelism routes attention by one; a backward
    call, which the engine recomputes in, runs outside them)."""
    return contextlib.nullcontext(), _Modes(_mode_stack())


@contextlib.contextmanager
def _recompute(modes: _Modes, kept: KeptBuffers) -> Iterator[None]:
    """A recomputation: under the forward's torch function modes, its buffers put back."""
    with kept, modes:
        yield


def recomputing(
    module: nn.Module,
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """torch.utils.checkpoint's ``context_fn`` for ``module``: as :func:`same_modes`, and
    the buffers the recomputation updates put back (:class:`KeptBuffers`)."""
    forward, modes = same_modes()
    return forward, _recompute(modes, KeptBuffers(module))


def _mode_stack() -> list[Any]:
    modes: list[Any] = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return modes


def apply_policy(stage: nn.Module, policy: Policy, stage_index: int) -> bool:
    """Wrap the chosen submodules' forward; True when the whole stage is to be recomputed
    (``"full"``). On a traced stage only the submodules its graph calls as modules (its
    units, see split/units.py) and their descendants run as modules: choosing any other
    is refused, naming it, since wrapping it would change nothing."""
    if policy is None:
        return False
    if policy == "full":
        return True
    if not callable(policy):
        check_policy(policy)
        return False
    traced = bool(getattr(stage, "meshpipe_model_inputs", False))
    units: tuple[str, ...] = getattr(stage, "meshpipe_units", ())
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in stage.named_modules():
        if name and policy(name, module):
            chosen.append((name, module))
    outside = [n for n, _ in chosen if traced and not _called(n, units)]
    if outside:
        raise PipelineError(
            f"activation_checkpointing chose {outside[:5]} on stage {stage_index}, which was "
            "split by tracing: those modules' code is part of the stage's traced graph and "
            f"never runs as a module there. Modules it calls as modules: {list(units)[:8]} "
            "and their submodules; choose among them, or use 'full'"
        )
    if not chosen:
        raise PipelineError(
            f"activation_checkpointing chose no submodule of stage {stage_index} (names such "
            f"as {[n for n, _ in stage.named_modules() if n][:5]})"
        )
    for name, module in chosen:
        if any(_under(name, other) for other, _ in chosen if other != name):
            continue  # an enclosing module is recomputed already
        module.forward = partial(_checkpointed, module, module.forward)
    return False


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _called(name: str, units: tuple[str, ...]) -> bool:
    return any(_under(name, unit) for unit in units)


def backward_plan(policy: Policy, full: bool, compiled: str, dp: str | None) -> tuple[bool, bool]:
    """(replay, fused backward) of a stage. "full" replays the stage's forward once, at I,
    on plain stages and on stages compiled with a split backward (``compiled == "split"``:
    the replay runs the compiled forward, whose halves then keep I and W apart; until
    2026-12-03 those used torch.utils.checkpoint with the whole backward in I).
    torch.utils.checkpoint (chosen submodules, FSDP2 stages, stages compiled with a fused
    backward) recomputes per backward call, so there the whole backward runs in I (W
    empty) rather than recomputing twice. A fused compiled backward (``"fused"``) runs
    whole in I."""
    replay = full and compiled != "fused" and dp not in ("fsdp", "hsdp")
    return replay, compiled == "fused" or (policy is not None and not replay)


# -- "full" on plain stages: F keeps no activations, I runs the forward again ----------------
#
# torch.utils.checkpoint recomputes per backward call, so with the zero-bubble split (I and
# W are two calls) it would recompute twice. Plain stages with "full" therefore *replay*
# instead: F runs with autograd recording but every tensor it would save dropped (the
# outputs keep their requires_grad, which the receiving stage relies on); I runs the
# forward again, with F's random state, and both I and W use that one fresh graph.


class Replay:
    """What I needs to run a stage's forward again: its inputs and F's random state."""

    def __init__(
        self, call: Callable[[], Any], device: torch.device, module: nn.Module | None = None
    ) -> None:
        self._call = call
        self._device = device
        self._module = module  # whose buffers the replay leaves as they were
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def run(self) -> Any:
        """The forward again, recording its graph, with the random state F had."""
        devices = [self._device] if self._cuda is not None else []
        with torch.random.fork_rng(devices=devices), KeptBuffers(self._module):
            torch.set_rng_state(self._cpu)
            if self._cuda is not None:
                torch.cuda.set_rng_state(self._cuda, self._device)
            return self._call()


def replays(then: Op | None, inputs: list[Any]) -> bool:
    """Whether a replayed stage's F drops its activations: not when the rank's next action
    (``then``) is this microbatch's B, or its I with input gradients to make. Then the
    replay would make them again at once, with nothing run in between: keeping them
    changes no peak of memory and saves a forward (Schedule.kept_forwards counts them; a
    first stage's I makes nothing: its W, later, runs the backward, so its F keeps
    nothing)."""
    if then is Op.B:
        return False
    return not (then is Op.I and any(getattr(x, "requires_grad", False) for x in inputs))


def _drop(_t: torch.Tensor) -> None:
    return None


def _never(_packed: Any) -> torch.Tensor:
    raise PipelineError("internal: the graph of a replayed stage's first forward was used")


def keeping_nothing() -> Any:
    """A context in which autograd records the graph but saves no tensor for backward."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _never)
