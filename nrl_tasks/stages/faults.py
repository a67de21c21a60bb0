"""Test hook: kill the current process at a named point of a stage (for kill-and-resume tests).

Set ``NRL_FAULT_KILL_AT`` to one or more comma-separated points ``stage@step[:where]`` with
``where`` one of ``before`` (stage entered, nothing done), ``during`` (the default: work done
or half-written, output not committed) or ``after`` (output committed, task not returned).
When the running stage reaches a matching point the process sends itself ``SIGKILL``: no
``finally`` blocks, no atexit handlers, exactly like an OOM kill or a lost machine.

This is a documented test hook, not a feature: never set it in production.

>>> parse_fault_points("generate@2, train@3:after")
{('generate', 2, 'during'), ('train', 3, 'after')}
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["ENV_VAR", "fault_point", "parse_fault_points"]

ENV_VAR = "NRL_FAULT_KILL_AT"
_WHERE = ("before", "during", "after")


def parse_fault_points(spec: str) -> set[tuple[str, int, str]]:
    """Parse ``stage@step[:where],...`` into a set of ``(stage, step, where)``."""
    points: set[tuple[str, int, str]] = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        head, _, where = item.partition(":")
        stage, sep, step = head.partition("@")
        where = where or "during"
        if not sep or not stage or not step.isdigit() or where not in _WHERE:
            raise ValueError(f"{ENV_VAR}: {item!r} is not 'stage@step[:before|during|after]'")
        points.add((stage, int(step), where))
    return points


def fault_point(stage: str, step: int, where: str = "during") -> None:
    """SIGKILL this process if ``NRL_FAULT_KILL_AT`` names ``(stage, step, where)``."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    if (stage, int(step), where) in parse_fault_points(spec):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
