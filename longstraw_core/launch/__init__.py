"""Starting and stopping a run: accelerate's settings, the output directory, every rank
on the same run, resume, the run's shape, stopping on a scheduler's signal."""
