"""``python -m benchmarks.bench_prompt_sharing --quick`` end to end (tiny model, in this process): each
variant trained, sharing skipped prompt tokens only when on, and the loss and gradient norm are those
of the plain forward to float32 rounding. No timing assertions."""

from __future__ import annotations

import math


def test_quick_run_returns_real_figures(capsys):
    from benchmarks.bench_prompt_sharing import main

    out = main(["--quick", "--repeats", "1"])
    assert "| micro-batch | share_prompt_prefix |" in capsys.readouterr().out
    assert set(out) == {"off_mbs8", "on_mbs8", "off_mbs32", "on_mbs32"}
    for mbs in (8, 32):
        off, on = out[f"off_mbs{mbs}"], out[f"on_mbs{mbs}"]
        assert off["prompt_tokens_not_rerun"] == 0 < on["prompt_tokens_not_rerun"]
        assert all(t > 0 for t in off["runs_s"] + on["runs_s"])
        assert math.isclose(on["loss"], off["loss"], rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(on["grad_norm"], off["grad_norm"], rel_tol=1e-4)
