"""The run lease (``storage.lease``): one writer per run, taken over when its holder dies."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Optional

import pytest

from storage import fs as sfs
from storage.lease import (
    LeaseHeldError,
    LeaseHolder,
    LeaseLostError,
    RunLease,
    lease_is_live,
    lease_name,
    read_lease,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _foreign(prefix: str, generation: int, *, age_s: float, ttl_s: float = 60.0, opts: Optional[dict] = None) -> LeaseHolder:
    """A lease file written by a process on another host, heartbeat ``age_s`` old."""
    now = time.time()
    holder = LeaseHolder(
        generation=generation, host="elsewhere.example", pid=4242, pid_create_time=1.0, pid_namespace="1",
        flow_run_id="run-elsewhere", acquired_at=now - age_s, heartbeat_at=now - age_s, ttl_s=ttl_s,
        token=uuid.uuid4().hex,
    )
    assert sfs.create_only(sfs.join(prefix, lease_name(generation)), holder.to_json(), opts)
    return holder


def _names(prefix: str, opts: Optional[dict] = None) -> list[str]:
    return sfs.list_dir(prefix, opts)


def test_acquire_refuse_names_the_holder_release(tmp_path):
    prefix = str(tmp_path / "lease")
    a = RunLease(prefix, flow_run_id="flow-a")
    held = a.acquire()
    assert held.generation == 1 and held.pid == os.getpid() and read_lease(prefix) == held
    assert lease_is_live(held)
    with pytest.raises(LeaseHeldError) as err:
        RunLease(prefix, flow_run_id="flow-b").acquire()
    text = str(err.value)
    assert f"pid {os.getpid()}" in text and "flow run flow-a" in text and "take_over=True" in text
    assert err.value.holder.token == held.token
    a.release()
    after = read_lease(prefix)
    assert after is not None and after.released and not lease_is_live(after)
    b = RunLease(prefix, flow_run_id="flow-b")
    assert b.acquire().generation == 2
    assert _names(prefix) == ["lease-000001.json", "lease-000002.json"]  # release deleted nothing
    b.release()


def test_context_manager_heartbeats(tmp_path):
    prefix = str(tmp_path / "lease")
    with RunLease(prefix, ttl_s=5, heartbeat_s=0.05) as held:
        first = read_lease(prefix).heartbeat_at
        deadline = time.time() + 10
        while read_lease(prefix).heartbeat_at == first and time.time() < deadline:
            time.sleep(0.02)
        assert read_lease(prefix).heartbeat_at > first
        assert read_lease(prefix).token == held.token
    assert read_lease(prefix).released


def test_take_over_after_sigkill(tmp_path):
    """A real holder process killed with SIGKILL: its pid is gone, the lease is taken at once
    (long before its heartbeat would go stale)."""
    prefix = str(tmp_path / "lease")
    script = textwrap.dedent(
        f"""
        import sys, time
        from storage.lease import RunLease
        lease = RunLease({prefix!r}, ttl_s=600, heartbeat_s=60, flow_run_id="doomed")
        lease.acquire()
        lease.start_heartbeat()
        print("held", flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeldError, match=f"pid {child.pid} flow run doomed"):
            RunLease(prefix, ttl_s=600).acquire()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(30)
    dead = read_lease(prefix)
    assert dead.pid == child.pid and not lease_is_live(dead)
    held = RunLease(prefix, ttl_s=600).acquire()
    assert held.generation == 2 and held.pid == os.getpid()


def test_reused_pid_is_not_the_holder(tmp_path):
    prefix = str(tmp_path / "lease")
    held = RunLease(prefix).acquire()
    assert lease_is_live(held)
    assert not lease_is_live(replace(held, pid_create_time=held.pid_create_time - 100))  # same pid, other process


def test_take_over_after_ttl_and_explicit_take_over(tmp_path):
    prefix = str(tmp_path / "lease")
    _foreign(prefix, 1, age_s=5, ttl_s=60)  # live-looking, on another host
    with pytest.raises(LeaseHeldError, match="host elsewhere.example pid 4242 flow run run-elsewhere, heartbeat 5 s ago"):
        RunLease(prefix).acquire()
    assert RunLease(prefix).acquire(take_over=True).generation == 2  # operator's decision

    prefix = str(tmp_path / "lease2")
    _foreign(prefix, 1, age_s=61, ttl_s=60)  # stale heartbeat: dead
    assert RunLease(prefix).acquire().generation == 2


def test_fencing(tmp_path):
    prefix = str(tmp_path / "lease")
    seen: list[Any] = []
    old = RunLease(prefix, ttl_s=2, heartbeat_s=0.05, on_lost=seen.append)
    old.acquire()
    assert old.heartbeat() and not old.lost
    old.ensure_held()
    old.start_heartbeat()
    new = RunLease(prefix, flow_run_id="new").acquire(take_over=True)
    deadline = time.time() + 10
    while not old.lost and time.time() < deadline:
        time.sleep(0.02)
    assert old.lost and len(seen) == 1 and seen[0].token == new.token
    with pytest.raises(LeaseLostError, match="taken over by host .* flow run new"):
        old.ensure_held()
    old.release()  # touches nothing of the new holder
    assert read_lease(prefix).token == new.token and not read_lease(prefix).released


def test_fencing_noticed_by_ensure_held_without_heartbeat(tmp_path):
    prefix = str(tmp_path / "lease")
    old = RunLease(prefix)
    old.acquire()
    RunLease(prefix).acquire(take_over=True)
    with pytest.raises(LeaseLostError):
        old.ensure_held()
    assert old.lost


def test_old_files_pruned(tmp_path):
    prefix = str(tmp_path / "lease")
    for _ in range(7):
        lease = RunLease(prefix)
        lease.acquire()
        lease.release()
    assert _names(prefix) == [lease_name(g) for g in range(4, 8)]


def _contend(prefix: str, opts: Optional[dict] = None) -> str:
    try:
        RunLease(prefix, storage_options=opts).acquire()
    except LeaseHeldError:
        return "refused"
    return "won"


@pytest.mark.parametrize("contenders", [2, 6])
def test_racing_take_over_threads(tmp_path, contenders):
    for round_ in range(5):
        prefix = str(tmp_path / f"lease{round_}")
        _foreign(prefix, 1, age_s=120)  # dead: every contender tries generation 2
        barrier = threading.Barrier(contenders)
        out: list[str] = []

        def run() -> None:
            barrier.wait()
            out.append(_contend(prefix))

        threads = [threading.Thread(target=run) for _ in range(contenders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(out) == ["refused"] * (contenders - 1) + ["won"], out
        assert read_lease(prefix).generation == 2


def _contend_process(prefix: str, barrier: Any, queue: Any, done: Any) -> None:
    barrier.wait()
    try:
        queue.put(_contend(prefix))
    except BaseException as exc:  # noqa: BLE001
        queue.put(f"{type(exc).__name__}: {exc}")
    done.wait(60)  # the winner stays alive until every contender has answered


def test_racing_take_over_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    contenders = 4
    for round_ in range(3):
        prefix = str(tmp_path / f"lease{round_}")
        _foreign(prefix, 1, age_s=120)
        barrier, queue, done = ctx.Barrier(contenders), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_contend_process, args=(prefix, barrier, queue, done)) for _ in range(contenders)]
        for p in procs:
            p.start()
        out = sorted(queue.get(timeout=60) for _ in procs)
        done.set()
        for p in procs:
            p.join(30)
        assert out == ["refused"] * (contenders - 1) + ["won"], out


@pytest.mark.s3
def test_lease_on_s3(moto_s3):
    opts = moto_s3.storage_options
    prefix = f"{moto_s3.make_bucket('nrl-lease-tests')}/{uuid.uuid4().hex[:10]}/lease"
    a = RunLease(prefix, storage_options=opts, ttl_s=5, heartbeat_s=0.1, flow_run_id="a")
    assert a.acquire().generation == 1
    with pytest.raises(LeaseHeldError, match="flow run a"):
        RunLease(prefix, storage_options=opts).acquire()
    assert a.heartbeat()
    b = RunLease(prefix, storage_options=opts, flow_run_id="b")
    assert b.acquire(take_over=True).generation == 2
    assert not a.heartbeat() and a.lost
    b.release()
    assert read_lease(prefix, opts).released
    # racing take-over of the released lease: one winner
    out: list[str] = []
    barrier = threading.Barrier(5)

    def run() -> None:
        barrier.wait()
        out.append(_contend(prefix, opts))

    threads = [threading.Thread(target=run) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) == ["refused"] * 4 + ["won"], out
    assert read_lease(prefix, opts).generation == 3
