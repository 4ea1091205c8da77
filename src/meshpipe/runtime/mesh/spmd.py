"""Per-stage SPMD on the non-pp axes, as the Pipeline runs it: TP, then FSDP2 (over every
replica, or HSDP over the (dp_replicate, dp) sub-mesh) or DDP-style replicas over
dp_replicate x dp, with gradient reduction once per step started at each stage's last
backward."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshpipe.errors import PipelineError
from meshpipe.parallel import (
    GradSync,
    apply_fsdp,
    apply_tp,
    check_tp_plan,
    fsdp_begin_step,
)
from meshpipe.parallel.ep import EpStats, apply_ep, check_ep_plan
from meshpipe.parallel.fsdp import fsdp_gather, fsdp_rest, gather_before, lend_param
from meshpipe.parallel.fsdp_plan import plan_fsdp
from meshpipe.parallel.replicas import broadcast_replicas
from meshpipe.parallel.tied_tp import TiesKept, shared_within, tied_mismatches
from meshpipe.parallel.tp import whole_over_tp
from meshpipe.runtime.failures.waits import Watchdog, wait_bounded
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.schedule.ir import Action, Op, Schedule
from meshpipe.split.tied import find_tied

__all__ = ["Spmd", "DP_MODES"]

log = logging.getLogger(__name__)

DP_MODES = (None, "ddp", "fsdp", "hsdp")
SHARDED = ("fsdp", "hsdp")  # the modes FSDP2 runs
Hook = Callable[[], None]


def _local_numel(p: torch.Tensor) -> int:
    """Elements of this process's shard of ``p`` (a DTensor) or of ``p``."""
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _split_by(
    params: Sequence[nn.Parameter], ids: Collection[int]
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the parameters whose id is not in ``ids``, those whose id is); once per step, so
    without ids (the usual case) it only copies the list."""
    if not ids:
        return list(params), []
    return [p for p in params if id(p) not in ids], [p for p in params if id(p) in ids]


def _names_of(module: nn.Module, name: str) -> tuple[str, ...]:
    """Every name ``module`` holds parameter ``name``'s tensor under, read before any stage
    is wrapped: a traced stage may hold a tied weight twice (the name export kept, often
    on a module it shares with another stage, and the head's own), and once the first
    stage is sharded the shared module's name already shows the shard."""
    tensor = module.get_parameter(name)
    return tuple(n for n, p in module.named_parameters(remove_duplicate=False) if p is tensor)


def _holder(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the submodule that registers parameter ``name``, its own name for it)."""
    path, _, leaf = name.rpartition(".")
    return module.get_submodule(path), leaf


def _ring(nbytes: int, n: int) -> int:
    """Bytes one process sends in a ring all-gather or reduce-scatter of ``nbytes`` over n."""
    return nbytes * (n - 1) // n


class Spmd:
    """How this rank's stages are parallelised over dp and tp, and the step's reductions."""

    def __init__(
        self,
        topo: Topology,
        dp: str | None,
        tp_plan: Mapping[str, Any] | None,
        mp_policy: Any | None,
        reshard_gap: int | None = 2,
        ep_plan: Sequence[str] | None = None,
        auto_plan: bool = False,
    ) -> None:
        if dp not in DP_MODES:
            raise PipelineError(f"dp must be one of {DP_MODES}, got {dp!r}")
        lay = topo.layout
        # with stage meshes every process checks every mesh, so all of them refuse alike
        tp_sizes = (
            {lay.shape(i)[1] for i in range(len(lay.grids))} if lay.stage_meshes else {topo.tp_size}
        )
        self._tp_sizes = sorted(t for t in tp_sizes if t > 1)
        self._plan_to_check = tp_plan
        self._auto_plan = auto_plan  # tp_plan="auto": the model's declared plan, translated
        self._tp_skip: dict[int, set[str]] = {}  # stage -> modules left whole (tied copies)
        if tp_plan is not None and topo.tp_size == 1:
            tp_plan = None  # a tp axis of size 1: nothing to split
        if self._plan_to_check is None and self._tp_sizes:
            raise PipelineError(
                f"a mesh's tp axis has size {self._tp_sizes[-1]} but no tp_plan was given; "
                "pass tp_plan={'*.up': ColwiseParallel(), ...} or build the mesh with tp=1"
            )
        if mp_policy is not None and dp not in SHARDED:
            raise PipelineError(
                "mp_policy needs dp='fsdp' or 'hsdp' (FSDP2 applies mixed precision)"
            )
        if dp == "hsdp" and topo.dp_size > 1 and topo.hsdp_mesh is None and not lay.stage_meshes:
            raise PipelineError(
                "dp='hsdp' shards within 'dp' and replicates across 'dp_replicate', but the "
                "mesh has no 'dp_replicate' axis; build it with meshpipe.init_mesh(pp=..., "
                "dp_replicate=..., dp=...), or pass dp='fsdp'"
            )
        self._check_ep(topo, ep_plan)
        self.ep_plan = ep_plan
        self.ep_stats = EpStats()
        self._experts: dict[int, list[nn.Parameter]] = {}  # stage -> its expert parameters
        # stage -> names of the parameters it shares with another stage of this rank, and
        # those parameters (one entry each): reduced over dp at the step's end (_check_shared)
        self._shared_names: dict[int, set[str]] = {}
        self._shared: dict[int, nn.Parameter] = {}
        # FSDP2 on one mesh: such a parameter is sharded once, by the first stage holding it
        # (its owner); borrower stage -> [(owner stage, owner's name, every name the
        # borrower holds it under)]
        self._borrowed: dict[int, list[tuple[int, str, tuple[str, ...]]]] = {}
        self._made_equal: set[int] = set()  # ids of the wrapped stages' parameters
        self._ties = TiesKept()
        self.topo = topo
        self.dp = dp if topo.dp_size > 1 else None  # dp= on size-1 axes is a no-op
        self._dp_mode = dp
        # FSDP2's unit: the 2-d (dp_replicate, dp) mesh for hsdp, every replica for fsdp (and
        # for hsdp on a stage mesh without dp_replicate: replicated across none)
        hsdp = self.dp == "hsdp" and topo.hsdp_mesh is not None
        self._shard_mesh = topo.hsdp_mesh if hsdp else topo.dp_mesh
        self.plain_allreduce = dp is None and topo.dp_size > 1
        self.tp_plan = tp_plan
        self.mp_policy = mp_policy
        self._syncs: dict[int, GradSync] = {}
        self._fsdp: dict[int, Any] = {}
        self.dp_bytes_per_step = 0
        self.dp_bytes_min = 0
        self._dp_bytes_base = 0
        self._param_bytes: dict[int, int] = {}
        # FSDP2: reshard a stage whose next action is at least this many actions away
        self.reshard_gap = reshard_gap

    @staticmethod
    def _check_ep(topo: Topology, ep_plan: Sequence[str] | None) -> None:
        """ep > 1 needs an ep_plan naming the experts modules, and no tp on that mesh."""
        eps = topo.ep_sizes or (1,)
        if max(eps) > 1 and ep_plan is None:
            raise PipelineError(
                f"a mesh has ep={max(eps)} but no ep_plan was given; pass ep_plan='auto' (a "
                "Hugging Face MoE model's declared plan) or ep_plan=['layers.*.moe.experts', "
                "...] naming the experts modules (docs/axes.md)"
            )
        lay = topo.layout
        tps = [lay.shape(i)[1] for i in range(len(lay.grids))] if lay.stage_meshes else None
        for i, ep in enumerate(eps):
            tp = topo.tp_size if tps is None else tps[i]
            if ep > 1 and tp > 1:
                raise PipelineError(
                    f"pp rank {i}'s mesh has ep={ep} and tp={tp}: expert parallelism beside "
                    "tensor parallelism is not built in meshpipe; use tp=1 where ep > 1"
                )

    def check(self, all_stages: Sequence[nn.Module], placement: Sequence[int]) -> None:
        """Checks that need every stage (same on every rank, before any communication): the
        tp plan against the stages it applies to (stage meshes: those on meshes of each tp
        size)."""
        lay = self.topo.layout
        for tp in self._tp_sizes:
            applies = [
                not lay.stage_meshes or lay.shape(placement[s])[1] == tp
                for s in range(len(all_stages))
            ]
            check_tp_plan(all_stages, self._plan_to_check, tp, applies)  # type: ignore[arg-type]
        if self._plan_to_check is not None:
            self._check_tied(all_stages, placement)
        self._check_shared(all_stages, placement)
        eps = self.topo.ep_sizes
        if self.ep_plan is not None:  # checked at ep=1 too: a wrong pattern fails now
            per_stage = [eps[placement[s]] if eps else 1 for s in range(len(all_stages))]
            check_ep_plan(all_stages, self.ep_plan, per_stage)

    def _check_shared(self, all_stages: Sequence[nn.Module], placement: Sequence[int]) -> None:
        """A parameter held by two stages of one rank (tied embeddings on a V schedule's first
        and last stage) is one tensor there. Each stage's own dp reduction (DDP-style
        replicas, FSDP2) would reduce it once per stage, or shard each stage's copy apart:
        wrong gradients (until 2026-12-03). FSDP2 on one mesh: the first stage holding it
        shards it and lends it to the others (``_borrowed``, ``_borrow``). Otherwise
        (DDP-style replicas; FSDP2 on stage meshes, where the copies are also summed whole
        across meshes) it stays out of the stages' reductions, whole on every replica, and
        is summed over dp once at the step's end; FSDP2's mixed precision cannot cast what
        it does not hold: refused then, on every rank alike."""
        # stage meshes: the mode as given, the same on every process (self.dp is per mesh)
        mode = self._dp_mode if self.topo.layout.stage_meshes else self.dp
        if mode not in ("ddp", *SHARDED):
            return
        me = self.topo.pp_rank if self.dp is not None else -1  # -1: nothing to keep out
        # stage meshes sum a tied weight's copies whole across meshes (split/tied.py): under
        # FSDP2 a copy alone on its rank stays whole too (refused mid-step before 2026-12-03)
        whole = self.topo.layout.stage_meshes and mode in SHARDED
        # FSDP2 on one mesh shards it once, in the first holder's unit, and lends it
        lends = mode in SHARDED and not self.topo.layout.stage_meshes
        shared: list[str] = []
        for where in find_tied(all_stages):
            by_rank: dict[int, list[int]] = {}
            for s in where:
                by_rank.setdefault(placement[s], []).append(s)
            for rank, stages in by_rank.items():
                if len(stages) < 2 and not (whole and len(by_rank) > 1):
                    continue
                said = f"{[where[s] for s in stages]} on stages {stages} of pp rank {rank}"
                if lends:
                    owner = min(stages)
                    log.info("tied parameters sharded once, by stage %d: %s", owner, said)
                    for s in stages:
                        if rank == me and s != owner:
                            names = _names_of(all_stages[s], where[s])
                            self._borrowed.setdefault(s, []).append((owner, where[owner], names))
                    continue
                shared.append(said)
                if rank == me:
                    for s in stages:
                        self._shared_names.setdefault(s, set()).add(where[s])
        if shared and self.mp_policy is not None:
            raise PipelineError(
                "mp_policy with tied parameters that FSDP2 must leave whole (on stage meshes, "
                f"summed whole across meshes: {'; '.join(shared)}): kept whole they would not "
                "be cast; untie them, use one mesh (meshpipe.init_mesh), or drop mp_policy"
            )
        if shared:
            log.info("tied parameters kept out of the stages' dp reductions: %s", shared)

    def _check_tied(self, all_stages: Sequence[nn.Module], placement: Sequence[int]) -> None:
        """Copies of a tied parameter laid out differently by the tp plan (a sharded head
        tied to a whole embedding; with stage meshes, sharded at all): the model's own plan
        ("auto") leaves the sharded copies whole, with a warning; an explicit plan is
        refused, on every rank alike."""
        lay, plan = self.topo.layout, self._plan_to_check
        tied = find_tied(all_stages)
        across = {(s, name) for where in tied for s, name in where.items()}
        tied += [w for w in shared_within(all_stages) if next(iter(w.items())) not in across]
        if plan is None or not tied:
            return
        tps = [
            lay.shape(placement[s])[1] if lay.stage_meshes else self.topo.tp_size
            for s in range(len(all_stages))
        ]
        bad = tied_mismatches(all_stages, plan, tied, tps, sharded_ok=not lay.stage_meshes)
        if not bad:
            return
        said = "; ".join(
            f"{first!r}: " + ", ".join(f"stage {s} {path!r} {how}" for s, path, how in copies)
            for first, copies in bad
        )
        if not self._auto_plan:
            raise PipelineError(
                "tied parameters would be laid out differently over tp on the stages holding "
                f"them, or sharded across stage meshes, whose copies are summed whole ({said}), "
                "so their gradients could not be summed: give every copy the "
                "same sharding (e.g. the embedding RowwiseParallel with the head "
                "ColwiseParallel) or none (leave the head out of tp_plan)"
            )
        for _first, copies in bad:
            for s, path, how in copies:
                if not how.startswith("whole"):
                    self._tp_skip.setdefault(s, set()).add(path)
        log.warning(
            "tp_plan='auto': tied parameters laid out differently over tp on the stages "
            "holding them (%s); their sharded copies stay whole: %s",
            said,
            {s: sorted(p) for s, p in self._tp_skip.items()},
        )

    def wrap(self, stage: int, module: nn.Module, timeout: float = 300.0) -> nn.Module:
        """Apply TP, make the dp replicas equal (replica 0's parameters and buffers, over
        dp_replicate x dp, for every dp mode; before FSDP2 shards them), then FSDP2 or
        replica sync, to one local stage module."""
        topo = self.topo
        if self.tp_plan is not None and topo.tp_mesh is not None:
            before = self._ties.before(module)
            apply_tp(module, topo.tp_mesh, self.tp_plan, self._tp_skip.get(stage, ()))
            try:  # a tensor two holders share here stays one (parallel/tied_tp.py)
                self._ties.keep(module, before)
            except ValueError as e:
                raise PipelineError(f"stage {stage}: {e}") from None
            if topo.tp_size > 1:  # what each tp rank holds whole: tp rank 0's (the shards
                # are tp rank 0's already: torch's styles scatter them from it)
                split_ids = {id(p) for p in module.parameters() if not whole_over_tp(p)}
                broadcast_replicas(
                    module, topo.tp_mesh.get_group(), stage, topo.device,
                    lambda work, what: wait_bounded(work, timeout, what, None),
                    skip=self._made_equal | split_ids, who="tp rank",
                )  # fmt: skip
        if topo.dp_group is not None:  # what an earlier stage of this process made equal: not
            broadcast_replicas(  # again (a tied weight it shares, already its FSDP2 shard)
                module, topo.dp_group, stage, topo.device,
                lambda work, what: wait_bounded(work, timeout, what, None),
                skip=self._made_equal,
            )  # fmt: skip
        experts = self._experts[stage] = self._apply_ep(module)
        names = self._shared_names.get(stage, set())
        shared = [p for n, p in module.named_parameters(remove_duplicate=False) if n in names]
        borrowed = {n for _o, _n, held in self._borrowed.get(stage, ()) for n in held}
        lent = [p for n, p in module.named_parameters(remove_duplicate=False) if n in borrowed]
        dp = topo.dp_size
        for p in shared:
            if id(p) not in self._shared:  # one all-reduce over dp at the step's end
                self._shared[id(p)] = p
                ring = 2 * _ring(p.numel() * p.element_size(), dp)
                self._dp_bytes_base += ring
                self.dp_bytes_per_step += ring
                self.dp_bytes_min += ring
        skip = {id(p) for p in (*experts, *shared, *lent)}
        plain: list[torch.Tensor] = [p for p in module.parameters() if id(p) not in skip]
        param_bytes = sum(p.numel() * p.element_size() for p in plain)
        if self.dp in SHARDED and self._shard_mesh is not None:
            ignored = {*experts, *shared, *lent}
            sharded = apply_fsdp(module, self._shard_mesh, self.mp_policy, ignored)
            self._fsdp[stage] = sharded
            self._borrow(stage, module)
            self._param_bytes[stage] = param_bytes
            # at least one all-gather and one reduce-scatter of the stage per step (ring),
            # hsdp: within dp, then an all-reduce of the shard across dp_replicate;
            # re-gathers after idle-time reshards are added when the step's hooks are planned
            shard = self._shard_size
            rep = dp // shard
            base = 2 * _ring(param_bytes, shard) + 2 * _ring(param_bytes // shard, rep)
            self._dp_bytes_base += base
            self.dp_bytes_per_step += base
            self.dp_bytes_min += base
        elif self.dp == "ddp" and topo.dp_group is not None:
            self._syncs[stage] = GradSync(list(plain), topo.dp_group)
            self.dp_bytes_per_step += 2 * _ring(param_bytes, dp)
            self.dp_bytes_min += 2 * _ring(param_bytes, dp)
        elif self.plain_allreduce:
            self.dp_bytes_per_step += 2 * _ring(param_bytes, dp)
            self.dp_bytes_min += 2 * _ring(param_bytes, dp)
        self._made_equal.update(id(p) for p in module.parameters())
        return module

    def _borrow(self, stage: int, module: nn.Module) -> None:
        """Point this stage's copies of tied parameters at the one its owner stage's FSDP2
        unit shards (wrapped before it: stages are wrapped in increasing order), and gather
        that unit before this stage runs."""
        units: list[Any] = []
        for owner, owner_name, names in self._borrowed.get(stage, ()):
            try:
                owned = self._fsdp[owner]
                holders = [_holder(module, n) for n in names]
                unit = lend_param(owned, _holder(owned, owner_name), holders)
            except (KeyError, ValueError) as e:
                raise PipelineError(
                    f"stage {stage}: cannot share {list(names)} with stage {owner}'s "
                    f"{owner_name!r} under FSDP2 ({e})"
                ) from None
            if all(unit is not u for u in units):
                units.append(unit)
                gather_before(module, unit)

    def _apply_ep(self, module: nn.Module) -> list[nn.Parameter]:
        """Shard the stage's experts over its ep group (after the replicas were made equal);
        their all-reduce over the expert replicas is counted with dp's bytes."""
        ep = self.topo.ep
        if ep is None or self.ep_plan is None:
            return []
        experts = apply_ep(module, self.ep_plan, ep.ep_mesh, self.ep_stats)
        local = sum(_local_numel(p) * p.element_size() for p in experts)
        self.dp_bytes_per_step += 2 * _ring(local, ep.replicas)
        self.dp_bytes_min += 2 * _ring(local, ep.replicas)
        self._dp_bytes_base += 2 * _ring(local, ep.replicas)
        return experts

    def split_experts(
        self, params: Sequence[nn.Parameter]
    ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(the others, the expert parameters) of ``params``."""
        return _split_by(params, {id(p) for ps in self._experts.values() for p in ps})

    def split_shared(
        self, params: Sequence[nn.Parameter]
    ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(the others, the parameters two local stages share, reduced at the step's end)."""
        return _split_by(params, self._shared.keys())

    @property
    def expert_group(self) -> Any:
        """The group expert gradients are summed over (None: nothing to sum)."""
        ep = self.topo.ep
        return None if ep is None else ep.replica_group()

    @property
    def _shard_size(self) -> int:
        """How many processes FSDP2 shards a stage over (hsdp: the dp axis only)."""
        if self.dp == "hsdp":
            return self.topo.dp_size // self.topo.replicate_size
        return self.topo.dp_size

    def gather(self) -> None:
        """Before a call that runs stage layers outside the stages' forward (generation):
        FSDP2 stages gathered (fsdp_gather)."""
        for module in self._fsdp.values():
            fsdp_gather(module)

    def rest(self) -> None:
        """After a call without a backward: FSDP2 stages back to their shards (fsdp_rest)."""
        for module in self._fsdp.values():
            fsdp_rest(module)

    def begin_step(self) -> None:
        for module in self._fsdp.values():
            fsdp_begin_step(module)

    def hooks(
        self, schedule: Schedule, rank: int, sync: bool = True, fsdp_sync: bool | None = None
    ) -> tuple[dict[Action, list[Hook]], dict[Action, list[Hook]]]:
        """(before, after) callbacks per action: gradient reductions right after each local
        stage's last backward action of the step (DDP-style buckets when ``sync``; FSDP2's
        reduce-scatter when ``fsdp_sync``, default ``sync``); FSDP2 reshards while a stage is
        idle and gathers ahead of its next use."""
        last: dict[int, Action] = {}
        for a in schedule.actions[rank]:
            if a.op is not Op.F:
                last[a.stage] = a
        after: dict[Action, list[Hook]] = {}
        for stage, action in last.items():
            if stage in self._syncs and sync:
                after.setdefault(action, []).append(self._syncs[stage].start)
        before: dict[Action, list[Hook]] = {}
        if self._fsdp:
            lent = {b: [o for o, _n, _ns in owners] for b, owners in self._borrowed.items()}
            fsync = sync if fsdp_sync is None else fsdp_sync
            plan = plan_fsdp(schedule.actions[rank], self._fsdp, self.reshard_gap, fsync, lent)
            for a, hs in plan.after.items():
                after.setdefault(a, []).extend(hs)
            for a, hs in plan.before.items():
                before.setdefault(a, []).extend(hs)
            shard = self._shard_size
            self.dp_bytes_per_step = self._dp_bytes_base + sum(
                n * _ring(self._param_bytes[s], shard) for s, n in plan.regathers.items()
            )
        return before, after

    def finish_step(self, timeout: float, watchdog: Watchdog | None = None) -> float:
        """Wait for replica reductions (stream waits under a CUDA ``watchdog``); returns the
        factor the reduced grads still need relative to a plain sum over every replica
        (FSDP2 averages over them, hsdp too: over dp, then across dp_replicate, so it needs
        ``dp_size``)."""
        for sync in self._syncs.values():
            sync.finish(
                lambda w: wait_bounded(w, timeout, "the gradient all-reduce over dp", watchdog)
            )
        return float(self.topo.dp_size) if self._fsdp else 1.0

    def collectives_in_actions(self, training: bool, sync: bool) -> bool:
        """Whether a step's actions run dp collectives (FSDP2's gathers and reduce-scatters,
        DDP's per-stage gradient all-reduces in a synced training step): a process that
        fails leaves its dp peers in one of those, never at the step's closing collective,
        which it must then not join over dp (runtime/failures/closing.py)."""
        return bool(self._fsdp) or (training and sync and bool(self._syncs))

    @property
    def tp_anywhere(self) -> bool:
        """Some stage's mesh has a tp axis above 1 (the same on every process)."""
        return bool(self._tp_sizes)

    @property
    def uses_fsdp(self) -> bool:
        return bool(self._fsdp)

    @property
    def grads_summed_elsewhere(self) -> bool:
        """True when dp reduction already happened per stage (not the plain all-reduce)."""
        return bool(self._syncs or self._fsdp)
