"""The pure, jittable part of a run: state, step, precision, optimizer, sharding, and the
compiled programs that call the step K times per dispatch."""
