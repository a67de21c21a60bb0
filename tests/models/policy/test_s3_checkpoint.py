"""Policy checkpoints on S3 (moto) moved by the workers themselves: rank 0 stages on its node and
uploads, every rank of a fresh policy downloads on its node; the driver stages nothing.

Each process's ``tempfile`` is pointed at its own directory and its ``tempfile.mkdtemp`` is
wrapped to record the directories it makes (a spy: the real function still runs), in the driver
and, through ``__ray_call__``, in every worker actor.
"""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest

from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.lm_policy import Policy

from .helpers import make_batch

SECRET = "nrl-test-secret-7f3a9c"


def _config(model_dir: str) -> PolicyConfig:
    return PolicyConfig(
        model_name=model_dir, train_global_batch_size=8, train_micro_batch_size=2, logprob_batch_size=4,
        max_total_sequence_length=64, optimizer={"kwargs": {"lr": 1e-3, "weight_decay": 0.01}},
        generation={"temperature": 0.8, "max_new_tokens": 6}, num_cpus_per_worker=0.5,
    )


def _actor_functions():
    """Functions run inside the worker actors (``__ray_call__``); nested so that they travel by
    value (the workers need not import this test module)."""

    def spy_tempdirs(actor, root: str) -> str:
        """Its own temp root, and a record of every ``mkdtemp`` in the actor's process."""
        import os
        import tempfile

        os.makedirs(root, exist_ok=True)
        tempfile.tempdir = root
        if not hasattr(tempfile, "_nrl_made"):
            real, made = tempfile.mkdtemp, []

            def spy(*args, **kwargs):
                path = real(*args, **kwargs)
                made.append(path)
                return path

            tempfile.mkdtemp, tempfile._nrl_made = spy, made
        return tempfile.gettempdir()

    def made_dirs(actor) -> list:
        import tempfile

        return list(tempfile._nrl_made)

    return spy_tempdirs, made_dirs


def _start(name: str, model_dir: str, tokenizer, namespace: str, root: str):
    import ray

    cluster = RayVirtualCluster([2], name=f"{name}-{uuid.uuid4().hex[:6]}", num_cpus_per_bundle=0.5)
    policy = Policy(cluster, _config(model_dir), tokenizer, name_prefix=name, namespace=namespace)
    roots = [os.path.join(root, f"{name}-rank{r}") for r in range(2)]
    spy_tempdirs, _ = _actor_functions()
    got = ray.get([w.__ray_call__.remote(spy_tempdirs, d) for w, d in zip(policy.worker_group.workers, roots)])
    assert got == roots
    return cluster, policy


def _worker_dirs(policy) -> list[list[str]]:
    import ray

    _, made_dirs = _actor_functions()
    return ray.get([w.__ray_call__.remote(made_dirs) for w in policy.worker_group.workers])


@pytest.mark.slow  # a whole flow run (+ resume): keeps make test under 15 minutes
def test_s3_checkpoint_round_trip_through_the_workers(ray_session, moto_s3, tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import storage.fs as sfs
    from nrl_tasks.stages.checkpoint import read_checkpoint_info, restore_checkpoint, save_checkpoint

    driver_tmp = tmp_path / "driver-tmp"
    driver_tmp.mkdir()
    driver_made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def spy(*args, **kwargs):
        path = real_mkdtemp(*args, **kwargs)
        driver_made.append(path)
        return path

    monkeypatch.setattr(tempfile, "tempdir", str(driver_tmp))
    monkeypatch.setattr(tempfile, "mkdtemp", spy)

    opts = moto_s3.storage_options
    uri = f"{moto_s3.make_bucket()}/run/checkpoints/step_000001"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    namespace = f"nrl-test-{uuid.uuid4().hex[:8]}"
    batches = [make_batch(8, 24, seed=40 + i) for i in range(2)]
    loss_fn = ClippedPGLossFn()
    workers_tmp = str(tmp_path / "workers")

    cluster, a = _start("s3a", tiny_model_dir, tokenizer, namespace, workers_tmp)
    try:
        a.train(batches[0], loss_fn)
        saved = a.weights_checksum(as_sent=False)
        save_checkpoint(a, uri, {"step": 1, "weights_version": 1}, storage_options=opts)
        a.train(batches[1], loss_fn)
        continued = a.weights_checksum(as_sent=False)
        made_a = _worker_dirs(a)
    finally:
        a.shutdown()
        cluster.shutdown()

    files = sfs.walk_files(uri, opts)
    assert "checkpoint.json" in files and "weights/model.safetensors" in files and "weights/config.json" in files
    assert {"optimizer/optimizer.json", "optimizer/optimizer.safetensors", "optimizer/rng/rank_00001.safetensors"} <= set(files)
    assert any(f.startswith("weights/tokenizer") for f in files), files
    assert all(f.endswith((".safetensors", ".json", ".jinja")) for f in files), files  # no pickle
    assert read_checkpoint_info(uri, opts)["weights_version"] == 1
    # rank 0 staged on its own node and cleaned up; rank 1 wrote nothing
    staged = [d for d in made_a[0] if os.path.basename(d).startswith("nrl-ckpt-")]
    assert len(staged) == 1 and staged[0].startswith(os.path.join(workers_tmp, "s3a-rank0")), made_a
    assert not os.path.exists(staged[0]) and made_a[1] == []

    cluster, b = _start("s3b", tiny_model_dir, tokenizer, namespace, workers_tmp)
    try:
        assert b.weights_checksum(as_sent=False) != saved
        info = restore_checkpoint(b, uri, opts)
        assert info["step"] == 1 and b.weights_version == 1
        assert b.weights_checksum(as_sent=False) == saved  # bit-exact weights
        b.train(batches[1], loss_fn)
        assert b.weights_checksum(as_sent=False) == continued  # optimizer, scheduler, RNG too

        with pytest.raises(ValueError, match=r"weights_path 's3://.*/nothing/weights' holds no checkpoint files") as ei:
            b.load_checkpoint(f"{uri}/nothing/weights", storage_options={**opts, "secret": SECRET})
        assert SECRET not in str(ei.value) and SECRET not in repr(ei.value)
        made_b = _worker_dirs(b)
    finally:
        b.shutdown()
        cluster.shutdown()

    # every rank downloaded into a temp dir on its node and deleted it
    for rank, made in enumerate(made_b):
        downloads = [d for d in made if os.path.basename(d).startswith("nrl-ckpt-dl-")]
        assert downloads and all(d.startswith(os.path.join(workers_tmp, f"s3b-rank{rank}")) for d in downloads), made
        assert not any(os.path.exists(d) for d in downloads)
    # ... and the driver staged nothing
    assert driver_made == [] and os.listdir(driver_tmp) == []
