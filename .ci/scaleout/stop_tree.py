"""Stop one started server by its PID file: SIGTERM (or the given signal) to the process and
everything under it, SIGKILL what is left after the grace period, remove the PID file.

    python .ci/scaleout/stop_tree.py PIDFILE [GRACE_S] [SIGNAL]

Only the processes of that tree are signalled (never by name). Exit 0 when nothing is left.
"""

from __future__ import annotations

import os
import signal
import sys

import psutil


def stop_tree(pid: int, grace_s: float = 40.0, sig: int = signal.SIGTERM) -> list[int]:
    """Signal ``pid`` and its descendants; return the PIDs that had to be killed."""
    try:
        leader = psutil.Process(pid)
        procs = [leader] + leader.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return [p.pid for p in alive]


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 3:
        print(__doc__, file=sys.stderr)
        return 2
    pid_file = argv[0]
    grace = float(argv[1]) if len(argv) > 1 else 40.0
    sig = getattr(signal, argv[2]) if len(argv) > 2 else signal.SIGTERM
    if not os.path.exists(pid_file):
        return 0
    with open(pid_file, encoding="utf-8") as fh:
        text = fh.readline().strip()
    if text.isdigit():
        killed = stop_tree(int(text), grace, sig)
        if killed:
            print(f"stop_tree: SIGKILLed {killed} after {grace:g} s", file=sys.stderr)
    try:
        os.remove(pid_file)
    except FileNotFoundError:  # the server removed its own PID file on the way out
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
