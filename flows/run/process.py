"""Who runs a run, and what a dead flow process left of its local Ray.

``status.json`` records the flow process (``flow_process``: ``host``, ``pid``, ``started_unix``
= the process start time, seconds since the epoch) and, when that process started its own
local Ray, the Ray session directory (``local_ray``: ``host``, ``session_dir``).

- :func:`describe_status`: a ``running`` status whose flow process is gone from this machine
  (no such pid, or the pid now belongs to a process started at another time) reads
  ``crashed (flow process <pid> on <host> is gone)``; on another machine ``running?``.
- :func:`reap_local_ray`: a flow process killed with ``SIGKILL`` takes its Ray head (GCS,
  raylet: kernel fate-sharing) with it, but the raylet's ``ray::DashboardAgent`` and
  ``ray::RuntimeEnvAgent`` first try to report the raylet's death to the dead GCS and hang
  there for 60 s, re-parented to PID 1 and deaf to ``SIGTERM`` (Ray 2.60). The next flow of
  the run (a resume, a Prefect retry) kills what is left of that session by PID: only
  processes whose command line or open files lie under the recorded session directory, only
  on the recorded host, and only when the recorded flow process is gone.
- :func:`reap_prefect_server`: a flow process without ``PREFECT_API_URL`` runs Prefect's
  ephemeral API server as a child process (``uvicorn ... prefect.server.api.server:create_app``,
  ~200 MB); ``SIGKILL`` of the flow process orphans it, and it stays up until someone stops it.
  ``status.json`` records it (``prefect_server``: ``host``, ``pid``, ``started_unix``, from
  :func:`ephemeral_prefect_servers`) and the next flow of the run stops it by PID, with the same
  care: the recorded host, the recorded start time, that command line, the flow process gone.

>>> describe_status({"status": "completed"})
'completed'
>>> describe_status({"status": "running", "flow_process": {"host": "elsewhere.invalid", "pid": 1}})
'running?'
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any, Mapping

__all__ = [
    "current_process",
    "describe_status",
    "ephemeral_prefect_servers",
    "flow_process_alive",
    "reap_local_ray",
    "reap_prefect_server",
    "session_processes",
    "this_host",
]

#: Two start times closer than this (s) are the same process (psutil's clock ticks are 10 ms).
_START_TOLERANCE_S = 0.5


def this_host() -> str:
    """This machine's host name (as recorded in ``status.json``)."""
    return socket.gethostname()


def current_process() -> dict[str, Any]:
    """``{"host", "pid", "started_unix"}`` of this process (for ``status.json``)."""
    import psutil

    return {"host": this_host(), "pid": os.getpid(), "started_unix": psutil.Process().create_time()}


def flow_process_alive(info: Mapping[str, Any] | None) -> bool | None:
    """Whether the recorded process still runs: ``None`` when it cannot be told (another host,
    or no record), else ``True``/``False`` (a reused pid with another start time is ``False``)."""
    import psutil

    if not info or info.get("host") != this_host() or not isinstance(info.get("pid"), int):
        return None
    try:
        p = psutil.Process(int(info["pid"]))
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        started = info.get("started_unix")
        return started is None or abs(p.create_time() - float(started)) < _START_TOLERANCE_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # e.g. AccessDenied: the pid is taken by someone else's process
        return False


def describe_status(status: Mapping[str, Any]) -> str:
    """The run's status for people: the stored one, with ``running`` checked against its flow process."""
    state = str(status.get("status") or "unknown")
    if state != "running":
        return state
    info = status.get("flow_process") or {}
    alive = flow_process_alive(info)
    if alive is None:
        return "running?"
    if alive:
        return "running"
    return f"crashed (flow process {info.get('pid')} on {info.get('host')} is gone)"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def session_processes(session_dir: str) -> list[Any]:
    """``psutil.Process`` of every process of this machine (this one excepted) whose command
    line names ``session_dir`` or that holds a file open under it (a daemon or worker of that
    Ray session: agents and workers rename themselves ``ray::...`` but keep their logs open)."""
    import psutil

    root = os.path.realpath(session_dir)
    if not session_dir or root in ("/", os.path.realpath("/tmp")):
        raise ValueError(f"session_dir {session_dir!r} is not a Ray session directory")
    out = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if root in cmd or session_dir in cmd:
                out.append(p)
                continue
            name = p.info["name"] or ""
            if not (name.startswith("ray::") or "python" in name or name in ("raylet", "gcs_server")):
                continue
            if any(_under(os.path.realpath(f.path), root) for f in p.open_files()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def reap_local_ray(status: Mapping[str, Any], grace_s: float = 2.0) -> list[str]:
    """Kill what is left of the local Ray recorded in ``status`` when its flow process is gone
    from this machine; return ``name(pid)`` of the processes killed (``SIGTERM``, then ``SIGKILL``
    after ``grace_s``). Nothing happens for a Ray the run only connected to (none recorded), on
    another host, or while the recorded flow process lives."""
    ray_info = status.get("local_ray") or {}
    session_dir = ray_info.get("session_dir")
    if not session_dir or ray_info.get("host") != this_host():
        return []
    if flow_process_alive(status.get("flow_process")) is not False:
        return []
    procs = session_processes(str(session_dir))
    return _terminate(procs, grace_s, lambda p: f"{p.name()}({p.pid})")


#: What the command line of Prefect's ephemeral API server (a child of the flow process) contains.
EPHEMERAL_SERVER_APP = "prefect.server.api.server:create_app"


def ephemeral_prefect_servers() -> list[dict[str, Any]]:
    """``{"host", "pid", "started_unix"}`` of the ephemeral Prefect API servers this process started."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=False):
        try:
            if EPHEMERAL_SERVER_APP in " ".join(child.cmdline()):
                out.append({"host": this_host(), "pid": child.pid, "started_unix": child.create_time()})
        except psutil.Error:
            continue
    return out


def _terminate(procs: list[Any], grace_s: float, label: Any) -> list[str]:
    """SIGTERM ``procs``, SIGKILL what is left after ``grace_s``; ``label(p)`` of each one signalled."""
    import psutil

    names = []
    for p in procs:
        try:
            names.append(label(p))
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return names


def reap_prefect_server(status: Mapping[str, Any], grace_s: float = 5.0) -> list[str]:
    """Stop the ephemeral Prefect API servers recorded in ``status`` (``prefect_server``) when their
    flow process is gone from this machine; return ``name(pid)`` of those stopped. A recorded pid
    now held by another process (other start time or command line) is left alone."""
    import psutil

    if flow_process_alive(status.get("flow_process")) is not False:
        return []
    found = []
    for rec in status.get("prefect_server") or []:
        if not isinstance(rec, Mapping) or rec.get("host") != this_host() or not isinstance(rec.get("pid"), int):
            continue
        try:
            p = psutil.Process(int(rec["pid"]))
            same = abs(p.create_time() - float(rec.get("started_unix") or 0)) < _START_TOLERANCE_S
            if same and EPHEMERAL_SERVER_APP in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.Error, TypeError, ValueError):
            continue
    return _terminate(found, grace_s, lambda p: f"prefect-server({p.pid})")
