"""A small PNG plot of a run's reward (and eval accuracy) for the run summary artifact.

Prefect's UI renders a markdown image whose source is a ``data:image/png;base64,...`` URI inline
(checked in headless Chromium on Prefect 3.9's UI), so the summary carries the plot in the artifact
itself: no file server, nothing to expire. Drawn with Pillow (a TensorBoard dependency) as a
2-colour-plus-grid palette image of :data:`SIZE` pixels: about 1-3 KB, the same for every step of
any run length (the points are bucketed like the text curves), so the summary stays small.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence

__all__ = ["SIZE", "bucket_means", "plot_data_uri", "plot_png"]

#: width, height of the plot in pixels
SIZE = (360, 90)
_PAD = 6
_BG, _GRID, _REWARD, _EVAL = (255, 255, 255), (220, 220, 220), (31, 119, 180), (214, 39, 40)


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


def plot_png(rewards: Sequence[float | None], evals: Sequence[tuple[int, float]] = (), steps: int | None = None) -> bytes:
    """PNG bytes: ``rewards`` (one per step, ``None`` for a gap) as a blue line on the axis
    ``[min, max]`` of what is plotted, ``evals`` (``(index into rewards, accuracy)``) as red dots
    on the same axis; ``steps``: how many points the x axis spans (default ``len(rewards)``)."""
    from PIL import Image, ImageDraw

    w, h = SIZE
    img = Image.new("RGB", SIZE, _BG)
    draw = ImageDraw.Draw(img)
    for frac in (0.0, 0.5, 1.0):
        y = _PAD + round(frac * (h - 2 * _PAD))
        draw.line([(_PAD, y), (w - _PAD, y)], fill=_GRID)
    pts = bucket_means(_finite(rewards), w - 2 * _PAD)
    known = [v for v in pts if v is not None] + [float(a) for _, a in evals if math.isfinite(float(a))]
    if known:
        lo, hi = min(known), max(known)
        span = hi - lo or 1.0
        n = max(len(pts), 1)
        x_of = lambda i, total: _PAD + (w - 2 * _PAD) * (i / max(total - 1, 1))  # noqa: E731
        y_of = lambda v: h - _PAD - (h - 2 * _PAD) * ((v - lo) / span if hi > lo else 0.5)  # noqa: E731
        line: list[tuple[float, float]] = []
        for i, v in enumerate(pts):
            if v is None:
                if len(line) > 1:
                    draw.line(line, fill=_REWARD, width=2)
                line = []
                continue
            line.append((x_of(i, n), y_of(v)))
        if len(line) > 1:
            draw.line(line, fill=_REWARD, width=2)
        elif len(line) == 1:
            x, y = line[0]
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=_REWARD)
        total = steps or len(rewards)
        for idx, acc in evals:
            if math.isfinite(float(acc)):
                x, y = x_of(idx, max(total, 1)), y_of(float(acc))
                draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=_EVAL)
    buf = io.BytesIO()
    img.quantize(colors=8).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def plot_data_uri(rewards: Sequence[float | None], evals: Sequence[tuple[int, float]] = ()) -> str:
    """``data:image/png;base64,...`` of :func:`plot_png`."""
    return "data:image/png;base64," + base64.b64encode(plot_png(rewards, evals)).decode("ascii")
