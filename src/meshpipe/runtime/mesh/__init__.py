"""Where processes sit: the mesh and its topology, stage meshes, SPMD on the non-pp axes."""
