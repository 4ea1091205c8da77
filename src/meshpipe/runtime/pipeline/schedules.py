"""The schedules one Pipeline runs: its own, the same schedule for another microbatch count
(a short last batch), and the forward-only form of each (inference, evaluation)."""

from __future__ import annotations

from meshpipe.errors import PipelineError, ScheduleError
from meshpipe.schedule.ir import Op, Schedule
from meshpipe.schedule.registry import get_schedule
from meshpipe.schedule.validate import validate

__all__ = ["Schedules", "resolve_schedule", "inference_schedule"]


def resolve_schedule(
    schedule: str | Schedule,
    num_ranks: int,
    num_microbatches: int | None,
    stages_per_rank: int | None,
) -> Schedule:
    """A checked, validated schedule for ``num_ranks`` pp ranks (PipelineError otherwise)."""
    if isinstance(schedule, str):
        if num_microbatches is None:
            raise PipelineError(f"schedule {schedule!r} is a name: pass num_microbatches= as well")
        sched = get_schedule(schedule, num_ranks, num_microbatches, stages_per_rank)
    elif isinstance(schedule, Schedule):
        sched = schedule
        if num_microbatches is not None and num_microbatches != sched.num_microbatches:
            raise PipelineError(
                f"num_microbatches={num_microbatches} but the schedule has {sched.num_microbatches}"
            )
    else:
        raise PipelineError(f"schedule must be a name or a Schedule, got {type(schedule).__name__}")
    if sched.num_ranks != num_ranks:
        raise PipelineError(
            f"schedule {sched.name!r} is for {sched.num_ranks} ranks but the mesh's pp axis "
            f"has {num_ranks}"
        )
    try:
        validate(sched)
    except ScheduleError as e:
        raise PipelineError(f"schedule {sched.name!r} is not valid: {e}") from e
    return sched


def inference_schedule(schedule: Schedule) -> Schedule:
    """The forward actions of ``schedule`` only, in the same order and placement."""
    if schedule.is_inference:
        return schedule
    return Schedule(
        num_ranks=schedule.num_ranks,
        num_microbatches=schedule.num_microbatches,
        placement=schedule.placement,
        actions=tuple(tuple(a for a in row if a.op is Op.F) for row in schedule.actions),
        name=f"{schedule.name} (forward only)",
    )


class Schedules:
    """The pipeline's schedule and its variants, built once each and kept."""

    def __init__(
        self,
        schedule: str | Schedule,
        num_ranks: int,
        num_microbatches: int | None,
        stages_per_rank: int | None,
    ) -> None:
        self.main = resolve_schedule(schedule, num_ranks, num_microbatches, stages_per_rank)
        self._name = schedule if isinstance(schedule, str) else None
        self._num_ranks = num_ranks
        self._training: dict[int, Schedule] = {self.main.num_microbatches: self.main}
        self._inference: dict[int, Schedule] = {}

    def training(self, num_microbatches: int | None = None) -> Schedule:
        """The schedule for ``num_microbatches`` (the pipeline's own when None)."""
        num = self.main.num_microbatches if num_microbatches is None else num_microbatches
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise PipelineError(f"num_microbatches must be an int >= 1, got {num!r}")
        sched = self._training.get(num)
        if sched is None:
            if self._name is None:
                raise PipelineError(
                    "num_microbatches= per call needs the schedule given by name (a Schedule "
                    f"object is fixed at {self.main.num_microbatches} microbatches)"
                )
            sched = resolve_schedule(self._name, self._num_ranks, num, self.main.stages_per_rank)
            self._training[num] = sched
        return sched

    def inference(self, num_microbatches: int | None = None) -> Schedule:
        """The forward-only schedule for ``num_microbatches``."""
        sched = self.training(num_microbatches)
        infer = self._inference.get(sched.num_microbatches)
        if infer is None:
            infer = self._inference[sched.num_microbatches] = inference_schedule(sched)
        return infer
