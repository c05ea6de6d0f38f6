"""What a run reports: metric names in one place, the curves kept beside the run, the
final summary table."""
