"""The fault suites' plug-in: real faults at named points of a stage (kill-and-resume and fault tests).

Installed as a stage observer (``NRL_PLUGINS=tests.faults.injection``, set for the whole test
session by ``tests/conftest.py``, so flow processes started by the CLI or a Prefect worker load
it too); it acts only when one of the variables below is set. A stage's ``start`` point is
``before``, ``computed`` is ``during`` and ``committed`` is ``after``.

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
worker, the packed broadcast in either side of a refit; the broadcast, a few ms on a tiny model,
is also caught by a tripwire at its entry, :data:`TRIPWIRES`); then, with ``how=ray_kill`` (the
default), it freezes its own process (``SIGSTOP``, so the call cannot finish) and the flow
process calls ``ray.kill(actor, no_restart=True)``; with ``how=sigkill`` the actor process
``SIGKILL``\\ s itself. Either way the actor dies in the middle of the call, as it would on a
lost node. ``how=freeze`` only stops the process (``SIGSTOP``): a hung worker that neither
answers nor dies, until someone kills it (its pid is in the fault log). Each point fires once per flow process (a retry of the stage is not killed again).
``ray_kill`` needs the actor on this machine (it watches the process state); elsewhere it
falls back to ``sigkill``.

``NRL_FAULT_LOG=/path/file.jsonl`` (optional) records each actor kill (target, pid, the
frame it landed in, wall time), so a test can check the fault happened where it meant to.

**Disk full.** ``NRL_FAULT_FILL_DISK_AT=stage@step[:where]`` (points as above): when the stage
reaches the point, the flow process fills the file system of the run's storage root with a
file ``<root>/.nrl-fault-filler`` (zeros, until ``ENOSPC``); the test removes it to "free space".
Meant for a root on a small file system of its own (a tmpfs mount).

**Refit.** ``NRL_FAULT_REFIT_PARTIAL=STEP[,STEP...]`` makes the first attempt of the refit at
``STEP`` (in this process) fail mid-stream: the driver itself produces the first packed chunk of a
stream (zeros) and then drops the group, so the workers receive part of the bytes and fail
(:func:`inject_partial_stream`).

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
    "FaultInjector",
    "PARTIAL_ENV",
    "inject_partial_stream",
    "observer",
    "ACTOR_ENV_VAR",
    "ENV_VAR",
    "FILL_ENV_VAR",
    "FILLER_NAME",
    "fill_disk",
    "LOG_ENV_VAR",
    "arm_actor_kill",
    "fault_point",
    "parse_actor_faults",
    "parse_fault_points",
    "reset_actor_faults",
]

logger = logging.getLogger(__name__)

ENV_VAR = "NRL_FAULT_KILL_AT"
PARTIAL_ENV = "NRL_FAULT_REFIT_PARTIAL"
ACTOR_ENV_VAR = "NRL_FAULT_KILL_ACTOR_AT"
LOG_ENV_VAR = "NRL_FAULT_LOG"
FILL_ENV_VAR = "NRL_FAULT_FILL_DISK_AT"
FILLER_NAME = ".nrl-fault-filler"
_WHERE = ("before", "during", "after")
_HOW = ("ray_kill", "sigkill", "freeze")
_ROLES = ("policy", "generation")

#: ``(role, stage)`` -> names of the functions (code objects) whose presence on the actor's
#: main-thread stack means "inside the stage's call".
ACTOR_CALLS: dict[tuple[str, str], tuple[str, ...]] = {
    ("policy", "train"): ("train",),
    ("policy", "logprob"): ("get_logprobs", "get_reference_policy_logprobs"),
    ("policy", "checkpoint"): ("save_checkpoint",),
    # DPO's and SFT's stages on the policy
    ("policy", "dpo_train"): ("train",),
    ("policy", "reference_logprobs"): ("get_reference_policy_logprobs",),
    ("policy", "sft_train"): ("train",),
    ("policy", "refit"): ("packed_broadcast_producer",),
    ("generation", "generate"): ("generate_batch",),
    ("generation", "refit"): ("packed_broadcast_consumer",),
}

#: Calls short enough on a tiny model (one packed chunk: a few ms) that polling the stack can miss
#: them under load: the watcher also swaps the function, in its module and wherever it was
#: imported by name, for a tripwire that strikes as the call is entered. ``name -> module``.
TRIPWIRES: dict[str, str] = {
    "packed_broadcast_consumer": "nrl_tasks.utils.packed_tensor",
    "packed_broadcast_producer": "nrl_tasks.utils.packed_tensor",
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


def _strike(how: str) -> None:
    """Stop (``ray_kill``, ``freeze``) or SIGKILL this process, from whichever thread sees the call;
    never return (a return would let the call under attack finish, or tell the flow the watcher gave up)."""
    sys.stdout.flush()
    sys.stderr.flush()
    # A signal to one's own process lands asynchronously. Until it does, keep the GIL (no switch
    # for 30 s, busy loop of C calls): the call under attack cannot get back into Python, so it
    # cannot return its result first.
    sys.setswitchinterval(30.0)
    os.kill(os.getpid(), signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
    spin_end = time.monotonic() + 5.0
    while time.monotonic() < spin_end:
        pass
    while True:
        time.sleep(1.0)


def _set_tripwires(names: Sequence[str], how: str) -> list[tuple[Any, str, Any]]:
    import importlib

    undo = []
    for name in names:
        if name not in TRIPWIRES:
            continue
        original = getattr(importlib.import_module(TRIPWIRES[name]), name)

        def tripwire(*args: Any, **kwargs: Any) -> Any:
            _strike(how)

        tripwire.__name__ = tripwire.__qualname__ = name
        # the defining module and every module that imported the function by name
        # (``from ... import name`` binds it at import time, so both must be swapped)
        for module in list(sys.modules.values()):
            if getattr(module, "__dict__", {}).get(name) is original:
                setattr(module, name, tripwire)
                undo.append((module, name, original))
    return undo


def _watch_and_strike(_actor: Any, names: Sequence[str], how: str, timeout_s: float, started: str = "") -> str | None:
    """Runs in the actor's control thread: wait for a frame named in ``names`` on another
    thread (or a :data:`TRIPWIRES` call), then freeze (``ray_kill``: the flow process kills us;
    ``freeze``) or SIGKILL this process. ``started``: a file created once the watcher runs (the
    flow waits for it before the call)."""
    undo = _set_tripwires(names, how)
    if started:
        open(started, "w").close()
    me = threading.get_ident()
    wanted = set(names)
    end = time.monotonic() + timeout_s
    try:
        while time.monotonic() < end:
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                f = frame
                while f is not None:
                    if f.f_code.co_name in wanted:
                        _strike(how)
                    f = f.f_back
            time.sleep(0.0005)
    finally:
        for module, name, original in undo:
            setattr(module, name, original)
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
    import ray.cloudpickle

    from nrl_tasks.distributed.worker_groups import CONTROL_GROUP

    # the watcher runs in the actor, which may not have the tests package on its path: ship it by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
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
        import tempfile

        started = os.path.join(tempfile.gettempdir(), f"nrl-fault-{pid}-{role}-{stage}-{step}-{time.monotonic_ns()}")
        watcher = ctl.remote(_watch_and_strike, names, mode, WATCH_TIMEOUT_S, started)
        wait_end = time.monotonic() + 60.0  # a fast call (a tiny model's train) must not beat the watcher
        while not os.path.exists(started) and time.monotonic() < wait_end:
            time.sleep(0.005)
        if os.path.exists(started):
            os.remove(started)
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


# ---------------------------------------------------------------------------------- refit
def inject_partial_stream(generation: Any, info: dict[str, Any], version: int, deadline: float) -> None:
    """Driver-side rogue producer: send the first chunk of a stream, then drop the group."""
    import torch

    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
    from nrl_tasks.utils.packed_tensor import packed_broadcast_producer
    from nrl_tasks.utils.refit import RefitInfo, refit_fingerprint

    parsed = RefitInfo.from_dict(info)
    sizes = [max(1, int(torch.Size(s).numel()) * d.itemsize) for _, s, d in parsed.metadata]
    small = max(max(sizes[: max(1, len(sizes) // 2)]), sum(sizes) // 4, 1)  # several chunks
    fake = dict(info, buffer_size_bytes=small, fingerprint=refit_fingerprint(parsed.metadata, small))
    generation.prepare_refit_info(fake)
    from nrl_tasks.stages.refit import RefitFailedError, _ray_get, generation_world_size

    world = 1 + generation_world_size(generation)
    ip, port = "127.0.0.1", find_free_port()
    refs = generation.init_collective(ip, port, world, rank_offset=1)
    group = create_broadcast_group(ip, port, 0, world, timeout_s=max(1.0, deadline - time.monotonic()))
    _ray_get(refs, deadline, "init_collective (injected)")
    upd = generation.update_weights_from_collective(version)
    budget = [small]  # send roughly one chunk, then fail

    def items():
        sent = 0
        for name, shape, dtype in parsed.metadata:
            t = torch.zeros(shape, dtype=dtype)
            if sent > budget[0]:
                raise RefitFailedError("injected refit failure mid-stream (NRL_FAULT_REFIT_PARTIAL)")
            sent += t.numel() * t.element_size()
            yield name, t

    try:
        packed_broadcast_producer(items(), group, 0, None, buffer_size_bytes=small)
    except RefitFailedError:
        pass
    finally:
        group.close()
    import ray

    try:  # the consumers fail (peer gone) and stay stale
        ray.get(list(upd), timeout=max(1.0, deadline - time.monotonic()))
    except Exception:  # noqa: BLE001 - expected
        pass
    raise RefitFailedError("injected refit failure mid-stream (NRL_FAULT_REFIT_PARTIAL)")


# ---------------------------------------------------------------------------------- observer
_POINT = {"start": "before", "computed": "during", "committed": "after"}


class FaultInjector:
    """The stage observer that fires the faults named in the environment."""

    def __init__(self) -> None:
        self._partial_done: set[int] = set()

    def on_stage(self, ctx: Any, stage: str, point: str) -> None:
        fault_point(stage, ctx.step, _POINT[point])
        fill = os.environ.get(FILL_ENV_VAR)
        if fill and (stage, int(ctx.step), _POINT[point]) in parse_fault_points(fill):
            fill_disk(ctx.run.layout.root)
        if stage == "refit" and point == "start":
            self._maybe_partial_refit(ctx)

    def on_actor_call(self, ctx: Any, stage: str, role: str, workers: Sequence[Any]) -> None:
        arm_actor_kill(role, stage, ctx.step, workers)

    def _maybe_partial_refit(self, ctx: Any) -> None:
        steps = {s.strip() for s in os.environ.get(PARTIAL_ENV, "").split(",") if s.strip()}
        if str(ctx.step) not in steps or ctx.step in self._partial_done:
            return
        self._partial_done.add(ctx.step)
        version = ctx.policy.weights_version
        deadline = time.monotonic() + float(ctx.cfg.grpo.refit.timeout_s)
        ctx.generation.mark_stale()
        inject_partial_stream(ctx.generation, ctx.policy.prepare_refit_info(), version, deadline)


def fill_disk(root: str) -> int:
    """Fill the file system holding ``root`` (``<root>/.nrl-fault-filler``); bytes written."""
    import errno

    path = os.path.join(root, FILLER_NAME)
    chunk = b"\0" * (1 << 20)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            try:
                written += os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)
    _record({"kind": "disk_full", "root": root, "bytes": written, "t": time.time()})
    return written


def observer() -> FaultInjector:
    """``NRL_PLUGINS`` factory (always installed in tests; inert unless a fault variable is set)."""
    return FaultInjector()
