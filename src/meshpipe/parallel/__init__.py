"""SPMD parallelism inside each stage, on the mesh's non-pp axes: TP, FSDP2, DDP, clipping."""

from meshpipe.parallel.clip import clip_grad_norm_
from meshpipe.parallel.conv1d import Conv1DColwise, Conv1DRowwise
from meshpipe.parallel.ddp import GradSync
from meshpipe.parallel.fsdp import apply_fsdp, fsdp_begin_step, fsdp_reduce
from meshpipe.parallel.hf_plan import auto_tp_plan
from meshpipe.parallel.mla import MlaKvAProj
from meshpipe.parallel.moe_tp import ExpertsTP
from meshpipe.parallel.replicated import ReplicatedGradSum
from meshpipe.parallel.rowwise import OwnedRowwise
from meshpipe.parallel.tp import apply_tp, check_tp_plan

__all__ = [
    "Conv1DColwise",
    "Conv1DRowwise",
    "GradSync",
    "ReplicatedGradSum",
    "ExpertsTP",
    "MlaKvAProj",
    "OwnedRowwise",
    "auto_tp_plan",
    "apply_fsdp",
    "apply_tp",
    "check_tp_plan",
    "clip_grad_norm_",
    "fsdp_begin_step",
    "fsdp_reduce",
]
