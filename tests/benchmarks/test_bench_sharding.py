"""``python -m benchmarks.bench_sharding --quick`` end to end (tiny model, 2 Ray ranks): every layout
reports real figures, the sharded ones hold about half the state of the replicated one, and the
first step agrees across layouts; the colocated job samples what the separate one samples with one
model copy fewer in its actors. No timing assertions."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_quick_run_returns_real_figures(capsys, prefect_harness):
    # the colocation part runs two GRPO flows: on the session's Prefect test server, not an ephemeral one
    from benchmarks.bench_sharding import main

    out = main(["--quick", "--repeats", "1"])
    printed = capsys.readouterr().out
    rows = out["rows"]
    assert list(rows) == ["replicated", "fsdp2", "fsdp2+offload"]
    assert [r["parallel"] for r in rows.values()] == ["fsdp2-replicated", "fsdp2-sharded", "fsdp2-sharded"]
    full = rows["replicated"]["state_mb"]
    for name in ("fsdp2", "fsdp2+offload"):
        assert 0.45 * full <= rows[name]["state_mb"] <= 0.6 * full, name
        assert rows[name]["grad_norm"] == pytest.approx(rows["replicated"]["grad_norm"], rel=1e-4)
    for r in rows.values():
        assert len(r["peak_rss_mb"]) == 2 and min(r["peak_rss_mb"]) > 0
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0
    assert "fsdp2 state per rank <= 0.6 of replicated" in printed
    coloc = out["colocation"]
    assert list(coloc) == ["separate", "colocated"]
    assert coloc["colocated"]["rewards"] == coloc["separate"]["rewards"]  # same samples: same learning
    assert 0 < coloc["colocated"]["peak_actors_mb"] < coloc["separate"]["peak_actors_mb"]  # one model copy, not two
    assert "colocated vs separate generation" in printed
