"""``python -m benchmarks.bench_lora --quick`` end to end (tiny model): the figures it returns are real
numbers of the right shape: LoRA trains fewer parameters than full, a LoRA refit sends fewer bytes
than a full one (the adapters only), every
policy worker reports a peak RSS, and the learning smoke runs record rewards. No timing assertions."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_quick_run_returns_real_figures(capsys, prefect_harness):
    # the session's Prefect test server: no ephemeral server to start (one timed out at 120 s
    # under the slow suite's load in a CI run)
    pytest.importorskip("peft")
    from benchmarks.bench_lora import LORA_LR_FACTOR, main

    out = main(["--quick", "--repeats", "1"])
    printed = capsys.readouterr().out

    rows = out["resources"]["rows"]
    assert list(rows) == ["full", "lora-r8", "lora-r32"]
    full = rows["full"]
    assert full["trainable_params"] == full["total_params"] > 0
    assert 0 < rows["lora-r8"]["trainable_params"] < rows["lora-r32"]["trainable_params"] < full["trainable_params"]
    # adapters-only refits: a LoRA refit carries the adapters, not the model
    assert 0 < rows["lora-r8"]["refit_bytes"] < rows["lora-r32"]["refit_bytes"] < full["refit_bytes"]
    for r in rows.values():
        assert r["total_params"] == full["total_params"]
        assert r["refit_bytes"] > 0 and r["refit_checksum_match"]
        assert r["peak_rss_mb"] >= r["rss_after_train_mb"] >= r["rss_after_setup_mb"] > 0
        for key in ("train_s", "train_median_s", "refit_s", "refit_setup_s"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["train_tokens"] > 8 * 4 * 16  # prompts + 16 new tokens per row
    for name in ("lora-r8", "lora-r32"):
        goal = out["resources"]["targets"][name]
        assert goal["refit_pct_of_full"] > 0 and goal["train_speedup"] > 0
        assert isinstance(goal["refit_reached"], bool) and isinstance(goal["train_reached"], bool)
        assert f"target {name}: refit bytes" in printed

    runs = out["learning"]["runs"]
    assert set(runs) == {"full", "lora-r8"}
    assert runs["lora-r8"]["lr"] == pytest.approx(LORA_LR_FACTOR["quick"] * runs["full"]["lr"])
    for r in runs.values():
        assert len(r["rewards"]) == 2 and all(math.isfinite(x) for x in r["rewards"])
        assert r["before"] is not None and r["after"] is not None

    assert "| config | trainable params | train s | speed-up vs full | refit MB | refit bytes % of full | refit s " \
           "| peak RSS MB |" in printed
    assert "| run | lr | train reward, first 3 steps | last 3 steps |" in printed
