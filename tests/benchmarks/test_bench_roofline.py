"""``benchmarks.bench_roofline``: the model FLOPs and bytes of each stage on a known batch (known answer),
and ``--quick`` end to end on the tiny model (bounds measured, each stage timed, fractions in (0, 1.5)).
No timing assertions."""

from __future__ import annotations

import pytest


def test_stage_work_counts_each_shared_prompt_once():
    from benchmarks.bench_actor import make_batch
    from benchmarks.bench_roofline import work

    batch = make_batch(vocab=100, prompts=2, samples=3, prompt_len=5, new=4, seed=0)
    n = 1000
    completions = int(batch["input_lengths"].sum()) - 6 * 5
    w = work(batch, n_params=n, new_tokens=4, samples=3)
    assert w["train"]["tokens"] == 2 * 5 + completions  # each prompt once, every completion token
    assert w["train"]["flops"] == 6 * n * (2 * 5 + completions)
    assert w["get_logprobs"]["flops"] == 2 * n * (2 * 5 + completions)
    # 2 prompts prefilled, then 3 decode steps of 6 rows; the weights read once per forward
    assert w["generate"]["flops"] == 2 * n * (2 * 5 + 6 * 3) and w["generate"]["bytes"] == 4 * n * 4


@pytest.mark.slow  # the bounds and three stages timed: ~10 s of make test's budget
def test_quick_run_measures_the_bounds_and_every_stage(capsys):
    from benchmarks.bench_roofline import main

    out = main(["--quick", "--repeats", "1"])
    text = capsys.readouterr().out
    assert "**matmul peak**" in text and "worst fraction:" in text
    assert out["peak_flops"] > 1e8 and out["bandwidth"] > 1e8
    assert set(out["stages"]) == {"get_logprobs", "train", "generate"}
    for stage in out["stages"].values():
        assert stage["s"] > 0 and 0 < stage["fraction"] < 1.5
