"""Ray scale-out: a GRPO run on a two-node Ray cluster started with ``ray start`` (head +
worker, token auth, explicit ports) by ``.ci/scaleout/ray_two_nodes.sh``.

The flow connects with ``cluster.ray.address``; ``cluster.ray.policy_resources`` /
``generation_resources`` pin the Policy to the node carrying ``node_policy`` and the
generation worker to the one carrying ``node_gen``, so every refit crosses nodes. The test
reads the node id of each actor (and of each placement-group bundle) from the cluster, then
resumes the run from a new process: the detached actors on the cluster are re-attached, not
re-created. Stopping the cluster by PID leaves no process behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import psutil
import pytest

from tests.fixtures.processes import alive
from tests.scaleout.helpers import NRL, REPO, TINY_CONFIG, clean_env, read_env_file, run

SCRIPT = os.path.join(REPO, ".ci", "scaleout", "ray_two_nodes.sh")
RUN_ID = "two-nodes"

# Runs in a subprocess: this test process may already hold a local Ray (one per process).
PROBE = r"""
import json, os, sys, ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
ns = sys.argv[1]
nodes = {n["NodeID"]: {k: v for k, v in n["Resources"].items() if k.startswith("node_")}
         for n in ray.nodes() if n.get("Alive")}
where = {}
for name in ("lm_policy-0", "generation-0"):
    actor = ray.get_actor(name, namespace=ns)
    where[name] = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=120)
pgs = {pg["name"]: sorted(set(pg["bundles_to_node_id"].values()))
       for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"}
names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ns)
print("PROBE" + json.dumps({"nodes": nodes, "actors": where, "pgs": pgs, "named": names}))
"""


def _probe(env: dict[str, str]) -> dict:
    out = run([os.path.join(os.path.dirname(NRL), "python"), "-c", PROBE, f"nrl-{RUN_ID}"], env, timeout=300)
    line = next(ln for ln in out.splitlines() if ln.startswith("PROBE"))
    return json.loads(line[len("PROBE") :])


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _start_cluster(env: dict[str, str]) -> str:
    """Bring the two-node cluster up; a node that exits fails it at once, with both node logs."""
    return run(["bash", SCRIPT, "start"], env, timeout=400)


@pytest.mark.slow
def test_policy_and_generation_on_different_nodes(tmp_path, tiny_model_dir):
    tmp = str(tmp_path)
    state = tempfile.mkdtemp(prefix="nrl-r2-", dir="/tmp")  # Ray's socket paths must stay < 108 bytes
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 inherited, as once leaked from an in-process local Ray
    # (Ray then refuses worker nodes even on Linux): the script must turn it back on
    env = clean_env(tmp, NRL_RAY2_DIR=state, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    storage_root = os.path.join(tmp, "runs")
    procs: list[psutil.Process] = []
    try:
        out = _start_cluster(env)
        address = re.search(r"RAY_ADDRESS=(\S+)", out).group(1)
        assert address.startswith("127.0.0.1:")
        cluster = read_env_file(os.path.join(state, "env"))
        assert cluster["RAY_AUTH_MODE"] == "token" and cluster["RAY_ADDRESS"] == address
        assert oct(os.stat(cluster["RAY_AUTH_TOKEN_PATH"]).st_mode & 0o777) == "0o600"
        env.update(cluster, NRL_KEEP_ACTORS="1")  # keep the detached actors to inspect and re-attach
        status = run(["bash", SCRIPT, "status"], env, timeout=120)
        assert "'node_policy': 1.0" in status and "'node_gen': 1.0" in status

        overrides = [
            f"cluster.ray.address={address}",
            "cluster.ray.policy_resources={node_policy: 1}",
            "cluster.ray.generation_resources={node_gen: 1}",
            f"policy.model_name={tiny_model_dir}",
            "grpo.max_num_steps=2",
            "logger.artifacts=false",
        ]
        out = run([NRL, "grpo", "--config", TINY_CONFIG, "--storage", storage_root, "--run-id", RUN_ID, *overrides], env, 900)
        assert f"run {RUN_ID} finished 2 steps" in out, out[-3000:]

        probe = _probe(env)
        nodes, actors = probe["nodes"], probe["actors"]
        assert len(nodes) == 2
        pol, gen = actors["lm_policy-0"], actors["generation-0"]
        assert pol != gen, "policy and generation workers share a node"
        assert nodes[pol] == {"node_policy": 1.0}
        assert nodes[gen] == {"node_gen": 1.0}
        assert probe["pgs"][f"{RUN_ID}-policy-pg0"] == [pol]
        assert probe["pgs"][f"{RUN_ID}-generation-pg0"] == [gen]
        assert probe["named"] == ["generation-0", "lm_policy-0"]

        # a new flow process re-attaches to the live actors on the cluster and extends the run
        out = run([NRL, "resume", RUN_ID, "--storage", storage_root, "grpo.max_num_steps=3"], env, 900)
        assert "attached to live policy actors at weights version 2" in out, out[-3000:]
        assert f"run {RUN_ID} finished 3 steps" in out
        assert _probe(env)["actors"] == actors  # the same actors, same nodes

        run_dir = os.path.join(storage_root, RUN_ID)
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            rows = [json.loads(x) for x in fh]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["refit_s"] is not None for r in rows)
        assert json.load(open(os.path.join(run_dir, "status.json")))["status"] == "completed"
        assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000003", "checkpoint.json"))
    finally:
        for name in ("head", "worker"):
            pid_file = os.path.join(state, f"{name}.pid")
            if os.path.exists(pid_file):
                procs += _tree(int(open(pid_file).read()))
        run(["bash", SCRIPT, "stop"], env, timeout=300)
        shutil.rmtree(state, ignore_errors=True)
    assert procs, "no cluster processes were found"
    left = [p for p in procs if alive(p)]
    assert not left, f"processes left after stop: {[(p.pid, p.name()) for p in left]}"
