"""What the reliability guarantees cost, side by side with the code of another commit.

    python -m benchmarks.bench_reliability [--quick] [--baseline-ref REF] [--repeats R]

- **Exclusive commit**: ``save_batch`` (create-only shards and manifest, cleanup after commit)
  and a fully verified ``load_batch`` (warm page cache, after one unmeasured read) of a rollout-shaped batch, this code vs the storage package
  of ``--baseline-ref`` (default ``bf70e63``, the commit before the reliability work), each in its
  own process on the same machine, same batch, best of ``--repeats``.
- **Run lease**: acquire + release, one heartbeat, one fence check (``ensure_held``), local disk.
- **Checkpoint verification**: hashing a checkpoint's files for its file list (at save) and
  checking them again (at restore), on a model-sized file, next to writing that file with fsync.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STORE_DRIVER = r"""
import json, os, shutil, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from benchmarks.bench_store import make_batch
from storage import load_batch, save_batch
rows, seq, repeats, work = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
batch = make_batch(rows, seq)
nbytes = sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))
save, load = [], []
for i in range(repeats):
    uri = os.path.join(work, f"b{i}")
    t0 = time.perf_counter(); save_batch(batch, uri, num_shards=4); save.append(time.perf_counter() - t0)
    load_batch(uri, verify=True)  # the first read after a write competes with writeback: not what is compared
    for _ in range(3):
        t0 = time.perf_counter(); load_batch(uri, verify=True); load.append(time.perf_counter() - t0)
    shutil.rmtree(uri)
print("STORE-JSON " + json.dumps({"save_s": min(save), "load_s": min(load), "mb": nbytes / 1e6}))
"""


def _store_run(tree: str, rows: int, seq: int, repeats: int, work: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [sys.executable, "-c", _STORE_DRIVER, tree, str(rows), str(seq), str(repeats), work],
        cwd=tree, env=env, capture_output=True, text=True, timeout=1800,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("STORE-JSON ")), None)
    if line is None:
        raise RuntimeError(f"store run in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def bench_store(ref: str, rows: int, seq: int, repeats: int, tmp: str) -> dict[str, Any]:
    tree = os.path.join(tmp, f"baseline-{ref}")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", tree, ref], check=True)
    try:
        # the baseline tree gets this tree's batch maker (bench_store.make_batch is unchanged API)
        work_a, work_b = os.path.join(tmp, "now"), os.path.join(tmp, "before")
        os.makedirs(work_a)
        os.makedirs(work_b)
        runs: dict[str, list[dict[str, Any]]] = {"now": [], "before": []}
        for _ in range(2):  # alternate the two trees (page cache and machine load drift between runs)
            runs["before"].append(_store_run(tree, rows, seq, repeats, work_b))
            runs["now"].append(_store_run(REPO, rows, seq, repeats, work_a))
        now, before = ({k: min(r[k] for r in rs) if k != "mb" else rs[0]["mb"] for k in rs[0]} for rs in (runs["now"], runs["before"]))
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], check=False)
    return {"now": now, "before": before}


def bench_lease(tmp: str, repeats: int) -> dict[str, float]:
    from storage.lease import RunLease

    prefix = os.path.join(tmp, "lease")
    acquire, beat, fence = [], [], []
    for _ in range(max(repeats, 5)):
        lease = RunLease(prefix, ttl_s=60.0, heartbeat_s=10.0, flow_run_id="bench")
        t0 = time.perf_counter()
        lease.acquire()
        t1 = time.perf_counter()
        lease.heartbeat()
        t2 = time.perf_counter()
        lease.ensure_held()
        t3 = time.perf_counter()
        lease.release()
        t4 = time.perf_counter()
        acquire.append((t1 - t0) + (t4 - t3))
        beat.append(t2 - t1)
        fence.append(t3 - t2)
    return {"acquire_release_ms": min(acquire) * 1e3, "heartbeat_ms": min(beat) * 1e3, "fence_ms": min(fence) * 1e3}


def bench_checkpoint_files(tmp: str, mb: int, repeats: int) -> dict[str, float]:
    from nrl_tasks.stages.checkpoint_files import file_manifest

    ck = os.path.join(tmp, "ck")
    os.makedirs(os.path.join(ck, "weights"))
    path = os.path.join(ck, "weights", "model.safetensors")
    data = os.urandom(1 << 20) * mb
    writes, hashes = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        writes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        file_manifest(ck)
        hashes.append(time.perf_counter() - t0)
    return {"mb": float(mb), "write_fsync_s": min(writes), "hash_s": min(hashes)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller batch and file")
    ap.add_argument("--baseline-ref", default="bf70e63")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows, seq, mb = (512, 1024, 64) if args.quick else (2048, 2048, 512)
    with tempfile.TemporaryDirectory(prefix="bench-rel-") as tmp:
        store = bench_store(args.baseline_ref, rows, seq, args.repeats, tmp)
        lease = bench_lease(tmp, args.repeats)
        ck = bench_checkpoint_files(tmp, mb, args.repeats)
    now, before = store["now"], store["before"]
    print(f"exclusive commit, {rows} x {seq} batch ({now['mb']:.0f} MB), best of {args.repeats}:")
    print(f"  {'':12} {'now':>10} {args.baseline_ref:>10} {'now/before':>11}")
    for key, label in (("save_s", "save MB/s"), ("load_s", "load MB/s")):
        a, b = now["mb"] / now[key], before["mb"] / before[key]
        print(f"  {label:12} {a:10.0f} {b:10.0f} {a / b:10.2f}x")
    print(f"run lease (local disk): acquire+release {lease['acquire_release_ms']:.2f} ms, heartbeat "
          f"{lease['heartbeat_ms']:.2f} ms, fence check {lease['fence_ms']:.2f} ms")
    print(f"checkpoint file list, {ck['mb']:.0f} MB file: hash {ck['hash_s']:.3f} s ({ck['mb'] / ck['hash_s']:.0f} MB/s) "
          f"vs write+fsync {ck['write_fsync_s']:.3f} s ({ck['hash_s'] / ck['write_fsync_s']:.2f}x of the write); "
          "paid once at save and once at restore")
    return {"store": store, "lease": lease, "checkpoint_files": ck}


if __name__ == "__main__":
    main()
