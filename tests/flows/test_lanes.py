"""GRPO's lanes are defined once (flows/algorithms/lanes.py): their callers (the step subflow,
the step driver, recovery; through GRPO's recipe) never call the data stages' tasks themselves,
and the checkpoint, refit and validation that end every algorithm's step are the step's own
(flows/algorithms/step.py: finish_step)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: the tasks the lanes run (checkpoint, refit and validate end every algorithm's step)
LANE_TASKS = {"prompts", "generate", "score", "dynamic_sampling", "logprob", "advantages", "train"}


def _imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nrl_tasks.stages."):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_the_drivers_run_the_stages_through_the_lanes_only():
    for rel in ("flows/algorithms/step.py", "flows/algorithms/driver.py", "flows/run/recovery.py"):
        assert not (_imported_names(ROOT / rel) & LANE_TASKS), (rel, sorted(_imported_names(ROOT / rel) & LANE_TASKS))
    assert LANE_TASKS <= _imported_names(ROOT / "flows/algorithms/lanes.py")
