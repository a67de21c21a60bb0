"""Test hooks: real faults at named points of a stage (for kill-and-resume and fault tests).

**Flow process.** Set ``NRL_FAULT_KILL_AT`` to one or more comma-separated points
``stage@step[:where]`` with ``where`` one of ``before`` (stage entered, nothing done),
``during`` (the default: work done or half-written, output not committed) or ``after``
(output committed, task not returned). When the running stage reaches a matching point the
process sends itself ``SIGKILL``: no ``finally`` blocks, no atexit handlers, exactly like an
OOM kill or a lost machine.

**Actors.** Set ``NRL_FAULT_KILL_ACTOR_AT`` to points ``role[#rank]:stage@step[:how]``: when
the flow reaches ``stage`` of ``step`` it arms a watcher in the named actor (``role`` is
``policy`` or ``generation``, rank 0 unless ``#rank``). The watcher runs in the actor's
control thread and waits until the actor's main thread is inside the stage's call
(:data:`ACTOR_CALLS`, e.g. ``train`` in the policy worker, the sampling loop in a generation
worker, the packed broadcast in either side of a refit); then, with ``how=ray_kill`` (the
default), it freezes its own process (``SIGSTOP``, so the call cannot finish) and the flow
process calls ``ray.kill(actor, no_restart=True)``; with ``how=sigkill`` the actor process
``SIGKILL``\\ s itself. Either way the actor dies in the middle of the call, as it would on a
lost node. ``how=freeze`` only stops the process (``SIGSTOP``): a hung worker that neither
answers nor dies, until someone kills it (its pid is in the fault log). Each point fires once per flow process (a retry of the stage is not killed again).
``ray_kill`` needs the actor on this machine (it watches the process state); elsewhere it
falls back to ``sigkill``.

``NRL_FAULT_LOG=/path/file.jsonl`` (optional) records each actor kill (target, pid, the
frame it landed in, wall time), so a test can check the fault happened where it meant to.

These are documented test hooks, not features: never set them in production.

>>> sorted(parse_fault_points("generate@2, train@3:after"))
[('generate', 2, 'during'), ('train', 3, 'after')]
>>> sorted(parse_actor_faults("policy:train@2, generation#1:refit@3:sigkill"))
[('generation', 1, 'refit', 3, 'sigkill'), ('policy', 0, 'train', 2, 'ray_kill')]
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Sequence

__all__ = [
    "ACTOR_CALLS",
    "ACTOR_ENV_VAR",
    "ENV_VAR",
    "LOG_ENV_VAR",
    "arm_actor_kill",
    "fault_point",
    "parse_actor_faults",
    "parse_fault_points",
    "reset_actor_faults",
]

logger = logging.getLogger(__name__)

ENV_VAR = "NRL_FAULT_KILL_AT"
ACTOR_ENV_VAR = "NRL_FAULT_KILL_ACTOR_AT"
LOG_ENV_VAR = "NRL_FAULT_LOG"
_WHERE = ("before", "during", "after")
_HOW = ("ray_kill", "sigkill", "freeze")
_ROLES = ("policy", "generation")

#: ``(role, stage)`` -> names of the functions (code objects) whose presence on the actor's
#: main-thread stack means "inside the stage's call".
ACTOR_CALLS: dict[tuple[str, str], tuple[str, ...]] = {
    ("policy", "train"): ("train",),
    ("policy", "logprob"): ("get_logprobs", "get_reference_policy_logprobs"),
    ("policy", "checkpoint"): ("save_checkpoint",),
    ("policy", "refit"): ("packed_broadcast_producer",),
    ("generation", "generate"): ("generate_batch",),
    ("generation", "refit"): ("packed_broadcast_consumer",),
}

#: How long an armed watcher waits for the call before giving up (s).
WATCH_TIMEOUT_S = 300.0

_FIRED: set[tuple[str, int, str, int, str]] = set()
_FIRED_LOCK = threading.Lock()


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


def parse_actor_faults(spec: str) -> set[tuple[str, int, str, int, str]]:
    """Parse ``role[#rank]:stage@step[:how],...`` into ``(role, rank, stage, step, how)``."""
    out: set[tuple[str, int, str, int, str]] = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        target, sep, rest = item.partition(":")
        role, _, rank = target.partition("#")
        point, _, how = rest.partition(":")
        stage, sep2, step = point.partition("@")
        how = how or "ray_kill"
        ok = (
            sep and sep2 and role in _ROLES and (rank == "" or rank.isdigit()) and step.isdigit()
            and how in _HOW and (role, stage) in ACTOR_CALLS
        )
        if not ok:
            raise ValueError(
                f"{ACTOR_ENV_VAR}: {item!r} is not 'role[#rank]:stage@step[:ray_kill|sigkill|freeze]' with (role, stage) "
                f"one of {sorted(ACTOR_CALLS)}"
            )
        out.add((role, int(rank or 0), stage, int(step), how))
    return out


# ---------------------------------------------------------------------------------- in the actor
def _actor_pid(_actor: Any) -> int:
    return os.getpid()


def _watch_and_strike(_actor: Any, names: Sequence[str], how: str, timeout_s: float) -> str | None:
    """Runs in the actor's control thread: wait for a frame named in ``names`` on another
    thread, then freeze (``ray_kill``: the flow process kills us; ``freeze``) or SIGKILL this process."""
    me = threading.get_ident()
    wanted = set(names)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            f = frame
            while f is not None:
                if f.f_code.co_name in wanted:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    # A signal to one's own process lands asynchronously. Until it does, keep the
                    # GIL (no switch for 30 s, busy loop of C calls): the call under attack cannot
                    # get back into Python, so it cannot return its result first.
                    sys.setswitchinterval(30.0)
                    os.kill(os.getpid(), signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
                    spin_end = time.monotonic() + 5.0
                    while time.monotonic() < spin_end:
                        pass
                    while True:  # never reply: a reply would tell the flow process the watcher gave up
                        time.sleep(1.0)
                f = f.f_back
        time.sleep(0.0005)
    return None


# ---------------------------------------------------------------------------------- in the flow
def _record(event: dict[str, Any]) -> None:
    logger.warning("fault injected: %s", event)
    path = os.environ.get(LOG_ENV_VAR)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(event) + "\n")


def _local_process(pid: int) -> Any:
    try:
        import psutil

        proc = psutil.Process(pid)
        proc.status()
        return proc
    except Exception:  # noqa: BLE001 - not on this machine (or psutil missing)
        return None


def _kill_when_frozen(handle: Any, proc: Any, watcher: Any, event: dict[str, Any], kill: bool = True) -> None:
    """Wait until the actor froze itself inside the call, then ``ray.kill`` it (unless ``kill`` is False)."""
    import psutil
    import ray

    end = time.monotonic() + WATCH_TIMEOUT_S + 5.0
    while time.monotonic() < end:
        try:
            if proc.status() == psutil.STATUS_STOPPED:
                break
        except psutil.NoSuchProcess:
            return
        done, _ = ray.wait([watcher], timeout=0)
        if done:  # the watcher gave up (the call never came) or failed
            try:
                outcome = repr(ray.get(watcher))
            except Exception as exc:  # noqa: BLE001
                outcome = f"{type(exc).__name__}: {exc}"[:500]
            _record({**event, "fired": False, "watcher": outcome})
            return
        time.sleep(0.001)
    else:
        return
    if not kill:
        _record({**event, "fired": True, "t": time.time()})
        return
    ray.kill(handle, no_restart=True)
    try:  # a stopped process cannot act on the kill: let it run into it, then make sure
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        proc.kill()
    _record({**event, "fired": True, "t": time.time()})


def reset_actor_faults() -> None:
    """Forget which actor-fault points fired in this process (tests reusing a point)."""
    with _FIRED_LOCK:
        _FIRED.clear()


def arm_actor_kill(role: str, stage: str, step: int, workers: Sequence[Any]) -> bool:
    """Arm the ``NRL_FAULT_KILL_ACTOR_AT`` watchers matching ``(role, stage, step)`` on ``workers``
    (actor handles by rank). Call it right before the stage's remote call. Returns True if armed."""
    spec = os.environ.get(ACTOR_ENV_VAR)
    if not spec:
        return False
    import ray

    from nrl_tasks.distributed.worker_groups import CONTROL_GROUP

    armed = False
    for r_role, rank, r_stage, r_step, how in parse_actor_faults(spec):
        key = (r_role, rank, r_stage, r_step, how)
        if (r_role, r_stage, r_step) != (role, stage, int(step)) or rank >= len(workers):
            continue
        with _FIRED_LOCK:
            if key in _FIRED:
                continue
            _FIRED.add(key)
        handle = workers[rank]
        ctl = handle.__ray_call__.options(concurrency_group=CONTROL_GROUP)
        pid = int(ray.get(ctl.remote(_actor_pid), timeout=60))
        proc = _local_process(pid) if how in ("ray_kill", "freeze") else None
        if proc is None and how == "freeze":
            raise RuntimeError(f"{ACTOR_ENV_VAR}: 'freeze' needs the actor on this machine (pid {pid})")
        mode = how if proc is not None else "sigkill"
        names = ACTOR_CALLS[(role, stage)]
        watcher = ctl.remote(_watch_and_strike, names, mode, WATCH_TIMEOUT_S)
        event = {"kind": "actor_kill", "role": role, "rank": rank, "stage": stage, "step": int(step),
                 "how": mode, "pid": pid, "inside": list(names)}
        if mode in ("ray_kill", "freeze"):
            threading.Thread(
                target=_kill_when_frozen, args=(handle, proc, watcher, event, mode == "ray_kill"),
                name="nrl-fault", daemon=True,
            ).start()
        else:
            _record({**event, "fired": "armed", "t": time.time()})
        armed = True
    return armed
