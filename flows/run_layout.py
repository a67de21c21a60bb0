"""Where a run's files live: moved to :mod:`nrl_tasks.run_layout` (pure path code, below the flow
layer); this name stays for existing imports."""

from nrl_tasks.run_layout import DATA_STAGES, RunLayout, checkpoint_name, join_uri, parse_step_dir, step_dir, validate_run_id

__all__ = ["DATA_STAGES", "RunLayout", "checkpoint_name", "join_uri", "parse_step_dir", "step_dir", "validate_run_id"]
