"""Process groups (and meshes) made once per process and found again by every Pipeline that
needs the same ones.

A process group lives as long as the process: gloo keeps a thread reading its connections,
two running its collectives and a socket per peer, and torch 2.13 cannot free a locally
synchronised group and make another (the new one is given the freed one's name and meets
its rendezvous, pytorch#189073; docs/runtime.md). Made anew for every Pipeline, the groups
piled up: after 60 Pipelines built by ``Pipeline.from_plan`` in each of 4 processes on 2
cores (``benchmarks/bench_plan.py``), each process held about 1,000 threads, and a step
took 2 - 4 times as long as in a fresh process (docs/plan.md, "Measured").

So the groups a Pipeline adds to its mesh (the control group, ``back``, a stage-mesh
pipeline's data group, the tied-parameter groups) and the meshes ``Pipeline.from_plan``
builds are made once per purpose and set of processes, and handed out again. Construction
is collective (every process of a group builds the same Pipelines in the same order), so
each process finds or makes the same groups, and the serial handed out with a group (how
many times it was handed out before) is the same on all of them: what must not mix
between Pipelines that share a group travels under a tag made from it. A Pipeline whose
step failed retires what was made (:func:`retire`), on every process: the next Pipeline
makes new groups and meshes, as it did before they were shared.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["retire", "shared"]

T = TypeVar("T")

_made: dict[Hashable, Any] = {}  # key -> the object
# key -> times an object was handed out for it, retired ones' included (so that a serial is
# never handed out twice over the same processes: a retired group's Pipeline may have
# left receives posted on a group that stays, the mesh's pp group)
_count: dict[Hashable, int] = {}
_world: list[Any] = [None]  # the default process group the objects above belong to


def shared(key: Hashable, make: Callable[[], T]) -> tuple[T, int]:
    """The object ``make()`` made for ``key`` in this process (made now the first time, or
    the first time since it was retired), and how many times an object was handed out for
    ``key`` before. A new default process group (the job's
    ``destroy_process_group`` and a new ``init_process_group``) starts afresh."""
    _check_world()
    if key not in _made:
        obj = make()
        _check_world()  # make() may have started the default group (init_mesh does)
        _made[key] = obj
    serial = _count.get(key, 0)
    _count[key] = serial + 1
    return _made[key], serial


def retire() -> None:
    """Hand out nothing made so far again: the next call for any key makes a new object
    (the serials count on). For a Pipeline whose step failed (a timeout closes gloo's
    connections; a failure can leave receives posted), on every process of the job (a
    Pipeline spans the job's processes, and each one's step raised), so that all of them
    make the same new groups: its control and back groups, its tied-parameter groups and
    its from_plan mesh alike."""
    _made.clear()


def _check_world() -> None:
    """Forget what belongs to another default process group than the job's now."""
    world = dist.group.WORLD
    if _world[0] is not world:
        _made.clear()
        _count.clear()
        _world[0] = world
