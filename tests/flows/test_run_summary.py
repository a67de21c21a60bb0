"""The run summary artifact's content (worked examples) and its bounded size."""

from __future__ import annotations

from flows.observe.summary import CURVE_WIDTH, metrics_window, sparkline, summary_markdown


def _rows(n: int) -> list[dict]:
    return [{"step": s, "reward_mean": s / n, "loss": 0.5, "step_s": 2.0,
             **({"val_accuracy": 0.1 * s} if s % 5 == 0 else {})} for s in range(1, n + 1)]


def test_summary_after_ten_steps():
    md = summary_markdown("r1", _rows(10), 40, checkpoints=[(5, "runs/r1/checkpoints/step_000005"),
                                                            (10, "runs/r1/checkpoints/step_000010")], plot=False)
    assert "# Run `r1`: step 10 of 40" in md
    assert "| reward (latest) | 1.000 |" in md and "| reward (best) | 1.000 at step 10 |" in md
    assert "| time per step | 2.00 s (median of the last 10) |" in md
    assert "| ETA | 1m00s |" in md  # 30 steps left x 2 s
    assert "| eval accuracy (latest, best) | 1.000, 1.000 at step 10 |" in md
    assert "| last checkpoint | step 10: `runs/r1/checkpoints/step_000010` |" in md
    assert "| best checkpoint (val_accuracy) | step 10 (1.000): `runs/r1/checkpoints/step_000010` |" in md
    assert "reward, steps 1..10: `▁▂▃▃▄▅▆▆▇█`" in md
    lower = summary_markdown("r1", _rows(10), 40, checkpoints=[(5, "a"), (10, "b")], higher_is_better=False, plot=False)
    assert "| best checkpoint (val_accuracy) | step 5 (0.500): `a` |" in lower


def test_summary_size_does_not_grow_with_the_run():
    sizes = [len(summary_markdown("r", _rows(n), 10_000, checkpoints=[(n, f"c/step_{n:06d}")], plot=False).encode())
             for n in (100, 1000, 5000)]  # the text; the plot's bound: test_summary_carries_a_small_png_plot...
    # once the curves are CURVE_WIDTH wide, only the digits of the step numbers differ
    assert sizes[0] <= sizes[1] and abs(sizes[2] - sizes[1]) < 40 and max(sizes) < 1500, sizes
    assert len(sparkline(list(range(5000)))) == CURVE_WIDTH
    assert [r["step"] for r in metrics_window(_rows(100), 3)] == [100, 99, 98]


def test_empty_run_and_missing_values():
    assert "no step finished yet (0 of 5)" in summary_markdown("r", [], 5)
    md = summary_markdown("r", [{"step": 1, "reward_mean": None}], 5)
    assert "| reward (latest) | n/a |" in md and "| ETA | n/a |" in md


def test_summary_carries_a_small_png_plot_of_reward_and_eval():
    import base64
    import io

    from PIL import Image

    from flows.observe.plot import BLUE, MAX_PNG_BYTES, RED, SIZE
    from flows.observe.summary import summary_markdown

    def plot_of(n: int) -> bytes:
        rows = [{"step": i, "reward_mean": i / n, **({"val_accuracy": 0.5} if i % 5 == 0 else {})} for i in range(1, n + 1)]
        md = summary_markdown("r", rows, n)
        return base64.b64decode(md.split("(data:image/png;base64,", 1)[1].split(")", 1)[0])

    png = plot_of(30)
    img = Image.open(io.BytesIO(png)).convert("RGB")
    assert img.size == SIZE
    colours = set(img.getdata())

    def near(c):  # the palette PNG keeps each colour within a few levels
        return any(sum(abs(a - b) for a, b in zip(c, have)) < 24 for have in colours)

    assert near(BLUE) and near(RED)  # the reward's moving average and the eval dots
    dark = sum(1 for p in img.getdata() if sum(p) < 200)  # text: tick numbers, axis labels, the legend
    assert dark > 300, dark
    assert len(png) < MAX_PNG_BYTES and len(plot_of(3000)) < MAX_PNG_BYTES  # small, whatever the run's length
    assert "data:image" not in summary_markdown("r", [{"step": 1, "reward_mean": 0.1}], 3, plot=False)
    assert "`▁" not in summary_markdown("r", _rows(10), 40) and "`▁" in summary_markdown("r", _rows(10), 40, plot=False)


def test_summary_lists_the_runs_history():
    from flows.run.history import begin_attempt, end_attempt

    h = begin_attempt({}, kind="start", flow_run_id="a", max_steps=10)
    # the first flow was SIGKILLed (left open, its process gone); the second restores and replays
    h = begin_attempt({"status": "running", "history": h}, kind="resume", flow_run_id="b", max_steps=10,
                      previous_outcome="crashed", previous_last_seen=1_796_000_000.0, trained=6, restore_from=4, replay=(5, 6))
    h = end_attempt(h, "failed", "RuntimeError: boom\nmore")
    h = begin_attempt({"status": "failed", "history": h}, kind="retry", flow_run_id="b", max_steps=10, trained=7,
                      restore_from=0, replay=(1, 2, 3, 4, 5, 6, 7))
    assert [(e["attempt"], e["kind"], e.get("outcome")) for e in h] == [(1, "start", "crashed"), (2, "resume", "failed"),
                                                                     (3, "retry", None)]
    md = summary_markdown("r", _rows(7), 10, plot=False, history=h)
    assert "**History** (3 flow run(s) of this run, UTC):" in md
    table = md.split("**History**", 1)[1].splitlines()
    # the killed flow's end is known only as "after its last heartbeat" (its lease's)
    assert table[4].startswith("| 1 | start |") and "| after " in table[4] and "| crashed | - | - | - |" in table[4], table[4]
    assert "| failed: RuntimeError: boom | 6 | checkpoint 4 | 5, 6 |" in table[5]
    assert table[6].endswith("| running | 7 | initial weights | 1..7 |")
    many = [e for _ in range(40) for e in h]
    assert len(summary_markdown("r", _rows(7), 10, plot=False, history=many).split("**History**", 1)[1].splitlines()) == 4 + 8
