"""Running this rank's actions: executor, stages, backward, recompute, compile, reductions."""
