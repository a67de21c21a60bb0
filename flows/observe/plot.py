"""Readable PNG plots for the run summary and the eval view (Prefect markdown artifacts).

Prefect's UI renders a markdown image whose source is a ``data:image/png;base64,...`` URI inline
(checked in headless Chromium on Prefect 3.9's UI), so an artifact carries its plot itself: no file
server, nothing to expire. Each plot (:func:`line_plot_png`) has axes with ticks and numbers, an x
label, a y label, a legend naming every series, and a **fixed 0-1 y scale when every value is a
rate** (rewards of 0/1 tasks, accuracies): a reward moving between 0.34 and 0.63 no longer looks
like a wild swing. Otherwise the scale spans the values with a margin and round ticks.

The run summary's plot (:func:`plot_png`): the reward per step (thin), its moving average
(:func:`moving_average`, thick) and the eval accuracy at each validation (dots). The eval view
draws accuracy and pass@k per checkpoint step.

Size: :data:`SIZE` pixels (readable on a laptop next to the artifact's text), drawn with Pillow
(a TensorBoard dependency) and its built-in FreeType font, saved as a 16-colour palette PNG: about
2-6 KB whatever the run's length (the points are bucketed to the plot's width, like the text
curves). The bound is 12 KB (tests), not the 4 KB of the earlier 360x90 plot without text: the text
that makes it readable costs the difference, once per artifact (the summary is updated in place,
:class:`flows.observe.artifacts.SummaryHandle`).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_PNG_BYTES", "PALETTE", "SIZE", "Series", "bucket_means", "line_plot_png", "moving_average", "plot_data_uri", "plot_png",
           "png_data_uri"]

#: width, height of a plot in pixels
SIZE = (640, 240)
#: what a plot's PNG may weigh at most (see the module docstring)
MAX_PNG_BYTES = 12_000
_LEFT, _RIGHT, _TOP, _BOTTOM = 46, 12, 26, 34
_BG, _AXIS, _GRID, _TEXT = (255, 255, 255), (90, 90, 90), (225, 225, 225), (40, 40, 40)
#: series colours (matplotlib's tab10: blue, light blue, red, green)
BLUE, LIGHT_BLUE, RED, GREEN = (31, 119, 180), (158, 202, 225), (214, 39, 40), (44, 160, 44)
#: colours of the series of a plot with several runs (tab10)
PALETTE = (BLUE, (255, 127, 14), GREEN, RED, (148, 103, 189), (140, 86, 75))


@dataclass(frozen=True)
class Series:
    """One curve: ``points`` ``(x, y)`` in data units (``y`` ``None``: a gap), drawn as a line of
    ``width`` pixels or, with ``dots``, as dots joined by a thin line."""

    label: str
    points: Sequence[tuple[float, float | None]]
    colour: tuple[int, int, int]
    width: int = 2
    dots: bool = False


def _finite(values: Sequence[float | None]) -> list[float | None]:
    return [None if v is None or not math.isfinite(float(v)) else float(v) for v in values]


def bucket_means(values: Sequence[float | None], width: int) -> list[float | None]:
    """``values`` as at most ``width`` points: the mean of each of ``width`` equal runs (``None``
    values left out; ``None`` for a run with none), or ``values`` itself when it fits."""
    if len(values) <= width:
        return list(values)
    out = []
    for b in range(width):
        part = [v for v in values[b * len(values) // width:(b + 1) * len(values) // width] if v is not None]
        out.append(sum(part) / len(part) if part else None)
    return out


def moving_average(values: Sequence[float | None], window: int) -> list[float | None]:
    """The mean of the last ``window`` known values at each point (``None`` until one is known).

    >>> moving_average([1.0, None, 3.0, 5.0], 2)
    [1.0, 1.0, 2.0, 4.0]
    """
    out, recent = [], []
    for v in values:
        if v is not None:
            recent = (recent + [float(v)])[-window:]
        out.append(sum(recent) / len(recent) if recent else None)
    return out


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering ``[lo, hi]`` (about ``count`` of them).

    >>> nice_ticks(0.0, 1.0)
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    >>> nice_ticks(1, 25)
    [5, 10, 15, 20, 25]
    """
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _label(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() and abs(v) >= 1 else f"{v:.2g}" if abs(v) < 0.01 and v else f"{v:.3g}"


def line_plot_png(series: Sequence[Series], *, x_label: str, y_label: str, x_range: tuple[float, float] | None = None) -> bytes:
    """PNG bytes of ``series`` on shared axes (see the module docstring); ``x_range``: the x axis's
    span (default: the points')."""
    from PIL import Image, ImageDraw, ImageFont

    w, h = SIZE
    img = Image.new("RGB", SIZE, _BG)
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=11)
    xs = [float(x) for s in series for x, _ in s.points]
    ys = [float(y) for s in series for _, y in s.points if y is not None and math.isfinite(float(y))]
    x0, x1 = x_range or ((min(xs), max(xs)) if xs else (0.0, 1.0))
    if x1 <= x0:
        x0, x1 = x0 - 0.5, x0 + 0.5
    if not ys or (min(ys) >= 0.0 and max(ys) <= 1.0):
        y0, y1 = 0.0, 1.0  # rates: a fixed scale
    else:
        lo, hi = min(ys), max(ys)
        pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
        y0, y1 = lo - pad, hi + pad
    px = lambda x: _LEFT + (w - _LEFT - _RIGHT) * (float(x) - x0) / (x1 - x0)  # noqa: E731
    py = lambda y: h - _BOTTOM - (h - _TOP - _BOTTOM) * (float(y) - y0) / (y1 - y0)  # noqa: E731
    for t in nice_ticks(y0, y1):  # y grid, ticks and numbers
        y = py(t)
        draw.line([(_LEFT, y), (w - _RIGHT, y)], fill=_GRID)
        draw.line([(_LEFT - 4, y), (_LEFT, y)], fill=_AXIS)
        draw.text((_LEFT - 6, y), _label(t), fill=_TEXT, font=font, anchor="rm")
    for t in nice_ticks(x0, x1, 6):  # x ticks and numbers
        x = px(t)
        draw.line([(x, h - _BOTTOM), (x, h - _BOTTOM + 4)], fill=_AXIS)
        draw.text((x, h - _BOTTOM + 6), _label(t), fill=_TEXT, font=font, anchor="mt")
    draw.line([(_LEFT, _TOP), (_LEFT, h - _BOTTOM), (w - _RIGHT, h - _BOTTOM)], fill=_AXIS)
    draw.text(((_LEFT + w - _RIGHT) / 2, h - 4), x_label, fill=_TEXT, font=font, anchor="mb")
    draw.text((4, 4), y_label, fill=_TEXT, font=font, anchor="lt")
    for s in series:
        pts = [(px(x), py(y)) for x, y in s.points if y is not None and math.isfinite(float(y))]
        segments, seg = [], []
        for x, y in s.points:  # a gap (None) breaks the line
            if y is None or not math.isfinite(float(y)):
                segments, seg = segments + [seg], []
            else:
                seg.append((px(x), py(y)))
        for part in segments + [seg]:
            if len(part) > 1:
                draw.line(part, fill=s.colour, width=1 if s.dots else s.width)
        if s.dots or len(pts) == 1:
            for x, y in pts:
                draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=s.colour)
    lx = w - _RIGHT  # the legend, right-aligned above the plot
    for s in reversed(series):
        tw = draw.textlength(s.label, font=font)
        draw.text((lx, 13), s.label, fill=_TEXT, font=font, anchor="rm")
        sx = lx - tw - 6
        if s.dots:
            draw.ellipse([sx - 10, 10, sx - 4, 16], fill=s.colour)
        else:
            draw.line([(sx - 18, 13), (sx - 2, 13)], fill=s.colour, width=s.width)
        lx = sx - 30
    buf = io.BytesIO()
    img.quantize(colors=16).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def plot_png(rewards: Sequence[float | None], evals: Sequence[tuple[int, float]] = (), steps: int | None = None,
             *, first_step: int = 1, label: str = "reward", eval_label: str = "eval accuracy") -> bytes:
    """The run summary's plot: ``rewards`` (one per step from ``first_step``, ``None`` for a gap;
    ``label``: what they are, e.g. a DPO run's pair accuracy), their moving average and ``evals``
    (``(index into rewards, figure)``, ``eval_label``); ``steps``: how many steps the x axis spans
    (default ``len(rewards)``)."""
    width = SIZE[0] - _LEFT - _RIGHT
    vals = _finite(rewards)
    n = max(len(vals), 1)
    window = max(2, min(10, n // 5))  # a moving average of at least 2 steps (of 1 it is the curve itself)
    stride = n / max(min(n, width), 1)  # bucketed: the x of bucket b is its middle step
    xs = [first_step + (b + 0.5) * stride - 0.5 for b in range(min(n, width))] if n > width else [first_step + i for i in range(n)]
    series = [Series(label, list(zip(xs, bucket_means(vals, width))), LIGHT_BLUE, width=1)]
    if n >= 4:
        series.append(Series(f"{label}, mean of {window}", list(zip(xs, bucket_means(moving_average(vals, window), width))), BLUE))
    if evals:
        series.append(Series(eval_label, [(first_step + i, _finite([a])[0]) for i, a in evals], RED, dots=True))
    last = first_step + max(steps or n, 1) - 1
    y_label = "reward / accuracy" if (label, eval_label) == ("reward", "eval accuracy") else f"{label} / {eval_label}"
    return line_plot_png(series, x_label="step", y_label=y_label, x_range=(first_step, max(last, first_step + 1)))


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def plot_data_uri(rewards: Sequence[float | None], evals: Sequence[tuple[int, float]] = (), *, first_step: int = 1,
                  label: str = "reward", eval_label: str = "eval accuracy") -> str:
    """``data:image/png;base64,...`` of :func:`plot_png`."""
    return png_data_uri(plot_png(rewards, evals, first_step=first_step, label=label, eval_label=eval_label))
