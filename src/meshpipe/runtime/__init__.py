"""The runtime: what runs a schedule on this process, grouped by job.

- ``pipeline/``: the public ``Pipeline`` and what it composes (stage modules, schedules,
  the step's driver, evaluation, clipping, traces).
- ``step/``: running this rank's actions (the executor, stages, backward and its I/W
  split, recompute, compile, microbatches, the loss and gradient reductions).
- ``transfer/``: moving values between ranks (the p2p program's transfers, the data and
  ctrl channels, value descriptions, receives posted ahead).
- ``mesh/``: where processes sit (the mesh and topology, stage meshes and how boundary
  values move between them, per-stage SPMD on the non-pp axes, tested torch versions).
- ``checks/``: the ranks agree that they were given the same call and inputs.
- ``failures/``: bounded waits, who waits for whom, who failed first, and how every rank
  learns that a step failed.

The packages re-export nothing: import a name from the module that defines it.
"""
