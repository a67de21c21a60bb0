"""Every server the project starts listens on 127.0.0.1 by default.

Checked by starting them and reading their listening sockets (psutil): the S3 servers of the
test fixtures (moto, the restartable moto, SeaweedFS), the Prefect API server, the rendezvous
store of the broadcast groups (refit); and by parsing every server command of the scripts
(``ray start``, ``prefect server start``, ``pg_ctl``, ``weed``, ``moto_server``, ``uvicorn``).

A local Ray (the project's ``connect_ray``) listens on loopback only too: its GCS, raylets,
core workers, runtime-env agent and the autoscaler's (unauthenticated) metrics endpoint, through
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (see ``nrl_tasks.distributed.virtual_cluster.loopback_only``);
its workers run at niceness 0, not Ray's default 15. The project also leaves Ray's token
authentication on (only the test session turns it off).
"""

from __future__ import annotations

import glob
import ipaddress
import json
import os
import re
import subprocess
import sys
from urllib.parse import urlparse

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def listening(pid: int, tree: bool = True) -> list[tuple[int, str, str, int]]:
    """``(pid, process name, ip, port)`` of every listening TCP socket of ``pid`` (and descendants)."""
    root = psutil.Process(pid)
    procs = [root] + (root.children(recursive=True) if tree else [])
    out = []
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((p.pid, p.name(), c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # "::ffff:127.0.0.1": a dual-stack socket bound to loopback
    return (mapped or addr).is_loopback


def assert_loopback_only(sockets, what: str) -> None:
    assert sockets, f"{what}: no listening socket found (wrong process?)"
    wide = [s for s in sockets if not is_loopback(s[2])]
    assert not wide, f"{what} listens beyond loopback: {wide}"


# --------------------------------------------------------------------------- servers, started
def test_moto_servers_listen_on_loopback_only(moto_s3, tmp_path):
    from tests.fixtures.s3 import RestartableS3Server, free_port

    assert_loopback_only(listening(moto_s3.process.pid), "moto_s3")
    port = free_port()
    server = RestartableS3Server("m", f"http://127.0.0.1:{port}", "k", "s", port=port, workdir=str(tmp_path))
    server.start()
    try:
        assert_loopback_only(listening(server.process.pid), "restartable moto")
    finally:
        server.stop()


def test_seaweedfs_listens_on_loopback_only(seaweed_s3):
    sockets = listening(seaweed_s3.process.pid)
    assert len({s[3] for s in sockets}) >= 5  # master, volume, filer, S3 and their gRPC ports
    assert_loopback_only(sockets, "weed mini")


def test_prefect_api_server_listens_on_loopback_only(prefect_harness):
    port = urlparse(prefect_harness).port
    owners = {c.pid for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert owners, f"nothing listens on the Prefect API port {port}"
    for pid in owners:
        assert_loopback_only(listening(pid), "Prefect API server")


def test_broadcast_group_store_listens_on_loopback():
    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port, get_node_ip

    assert get_node_ip() == "127.0.0.1"  # one machine: the address refit rendezvous uses
    port = find_free_port()
    group = create_broadcast_group("127.0.0.1", port, 0, 1, timeout_s=30)
    try:
        mine = [s for s in listening(os.getpid(), tree=False) if s[3] == port]
        assert_loopback_only(mine, "broadcast group store")
    finally:
        group.close()


# --------------------------------------------------------------------------- scripts, parsed
SERVER_COMMANDS = {
    # pattern of the command -> the flag(s) that must bind it to loopback
    r"\bray\"?\s+start\b": [r"--node-ip-address[= ]127\.0\.0\.1"],
    r"\bprefect\"?\s+server\s+start\b": [r"--host[= ]127\.0\.0\.1"],
    r"\bpg_ctl\"?\s.*\bstart\b": [r"-h 127\.0\.0\.1"],
    r"(^|[\s/\"])weed\"?\s+(mini|server|s3|master|volume|filer)\b": [r"-ip\.bind=127\.0\.0\.1"],
    r"\bmoto_server\b": [r"-H\s+127\.0\.0\.1"],
    r"\buvicorn\b": [r"--host[= ]127\.0\.0\.1"],
}


def shell_commands(path: str) -> list[str]:
    """Logical command lines of a script (continuations joined, comments dropped)."""
    out, cur = [], ""
    with open(path, encoding="utf-8") as fh:
        for raw in fh:
            line = raw.rstrip("\n")
            if not cur and line.lstrip().startswith("#"):
                continue
            if line.endswith("\\"):
                cur += line[:-1] + " "
                continue
            out.append((cur + line).split(" #", 1)[0])
            cur = ""
    return out


def script_files() -> list[str]:
    found = glob.glob(os.path.join(REPO, ".ci", "**", "*.sh"), recursive=True)
    found += [p for p in (os.path.join(REPO, "Makefile"), os.path.join(REPO, "prefect.yaml")) if os.path.exists(p)]
    return sorted(found)


def test_server_commands_in_scripts_bind_loopback():
    checked = []
    for path in script_files():
        for cmd in shell_commands(path):
            for pattern, flags in SERVER_COMMANDS.items():
                if re.search(pattern, cmd):
                    checked.append((os.path.relpath(path, REPO), pattern))
                    for flag in flags:
                        assert re.search(flag, cmd), f"{os.path.relpath(path, REPO)}: server command without {flag}: {cmd.strip()}"
                    if "ray" in pattern:  # dashboard flags may come through a wrapper's "$@"
                        whole = open(path, encoding="utf-8").read()
                        assert re.search(r"--dashboard-host[= ]127\.0\.0\.1|--include-dashboard[= ]false", whole), path
    assert checked, "no server command found: the patterns are out of date"


def test_the_parser_flags_a_wide_bind(tmp_path):
    bad = tmp_path / "start.sh"
    bad.write_text('# ray start --head\n"$BIN/ray" start --head \\\n  --port 6379 --block &\nprefect server start --host 0.0.0.0\n')
    cmds = shell_commands(str(bad))
    hits = [c for c in cmds for p, flags in SERVER_COMMANDS.items() if re.search(p, c) and not all(re.search(f, c) for f in flags)]
    assert len(hits) == 2 and "--port 6379" in hits[0]


def test_project_code_leaves_ray_token_auth_on():
    """Only tests may turn Ray's token authentication off (the project's Ray is reachable on
    the node address; the token is what guards it). Test runners (``.ci/test_vllm.sh``) and the
    benchmarks' local Rays are not checked here (see the report)."""
    offenders = []
    for pattern in ("flows/**/*.py", "nrl_tasks/**/*.py", "storage/**/*.py", ".ci/scaleout/**/*.sh"):
        for path in glob.glob(os.path.join(REPO, pattern), recursive=True):
            text = open(path, encoding="utf-8").read()
            if re.search(r"RAY_AUTH_MODE\W{1,6}disabled", text):
                offenders.append(os.path.relpath(path, REPO))
    assert not offenders, offenders


# --------------------------------------------------------------------------- Ray
_PROBE = r"""
import json, os, sys, psutil
sys.path.insert(0, sys.argv[1])
from flows.config import load_config
from flows.run.runtime import connect_ray
import ray
cfg = load_config(os.path.join(sys.argv[1], "configs", "grpo_tiny.yaml"))
connect_ray(cfg)
@ray.remote(num_cpus=0)
class Probe:
    def nice(self):
        return os.nice(0)
nice = ray.get(Probe.remote().nice.remote())
me = psutil.Process()
socks = []
for p in [me] + me.children(recursive=True):
    try:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                socks.append([p.pid, p.name(), " ".join(p.cmdline())[:200], c.laddr.ip, c.laddr.port])
    except psutil.Error:
        pass
switch = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")  # must not outlive the start
print(json.dumps({"socks": socks, "nice": nice, "gcs": ray.get_runtime_context().gcs_address, "switch": switch}))
ray.shutdown()
"""


def test_local_ray_of_the_project_listens_on_loopback_only_and_runs_workers_at_nice_0(tmp_path):
    import shutil
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    short = tempfile.mkdtemp(prefix="r", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env["RAY_TMPDIR"] = short
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, REPO], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300
        )
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Token authentication is enabled" in proc.stderr  # the project's default
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {s[1] for s in data["socks"]}
    assert "gcs_server" in names and "raylet" in names, data["socks"]
    # (the autoscaler's metrics endpoint, port 44217, is among them when that port is free: the test
    # session's own Ray may hold it)
    assert_loopback_only([tuple(s[:2]) + tuple(s[3:]) for s in data["socks"]], "the project's local Ray")
    assert data["gcs"].startswith("127.0.0.1:")
    assert data["nice"] == 0  # not Ray's default 15
    # the loopback switch was not left in the flow process's environment, where every later
    # child (a `ray start --address=...` among them) would inherit it; the Probe actor, started
    # after it was put back, is among the loopback-only listeners above
    assert data["switch"] is None
