"""The SVG chart code of the reports (lora_eval/svg.py): scales, ticks, what is drawn where, valid XML."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from lora_eval.render.svg import Figure, Scale, nice_ticks

NS = "{http://www.w3.org/2000/svg}"


def frame_of(root: ET.Element) -> tuple[float, float, float, float]:
    """(x, y, width, height) of the first panel's plot area: its frame is the rect with stroke #444."""
    rect = next(r for r in root.iter(f"{NS}rect") if r.get("stroke") == "#444")
    return tuple(float(rect.get(k)) for k in ("x", "y", "width", "height"))


def test_scales_map_linear_log_and_turned_round_limits(seed):
    rng = np.random.default_rng(seed)
    values = rng.uniform(1e-3, 1e2, 50)
    linear, log, turned = Scale(), Scale(log=True), Scale()
    linear.limits, log.limits, turned.limits = (-1.0, 3.0), (1e-4, 1e3), (10.0, -2.0)
    assert np.allclose(linear.fraction(values), (values + 1) / 4)
    assert np.allclose(log.fraction(values), (np.log10(values) + 4) / 7)
    assert np.allclose(turned.fraction(values), (10 - values) / 12)
    assert np.isnan(log.fraction([0.0, -1.0])).all()  # nothing drawn for values a log axis cannot show
    auto = Scale(log=True)
    auto.add(values, [0.0, np.nan])  # zeros and NaN ignored
    auto.resolve()
    lo, hi = auto.limits
    assert lo <= values.min() and hi >= values.max() and math.log10(lo) == int(math.log10(lo))


@pytest.mark.parametrize("lo,hi,integer", [(0, 1, False), (-3.7e-5, 2.2e-4, False), (0, 153, False),
                                           (-0.6, 7.6, True), (12, 13, False)])
def test_nice_ticks_are_round_and_inside(lo, hi, integer):
    ticks = nice_ticks(lo, hi, integer=integer)
    assert 2 <= len(ticks) <= 11 and all(lo - 1e-12 <= t <= hi + 1e-12 for t in ticks), ticks
    steps = np.diff(ticks)
    assert np.allclose(steps, steps[0])
    mantissa = steps[0] / 10 ** math.floor(math.log10(steps[0]))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5)), steps[0]
    if integer:
        assert all(t == int(t) for t in ticks)


def test_a_line_is_drawn_at_its_data_and_broken_at_nan(seed):
    rng = np.random.default_rng(seed)
    x = np.arange(20.0)
    y = rng.normal(0, 1, 20)
    y[7] = np.nan
    fig = Figure(600, 300)
    ax = fig.axes[0][0]
    ax.line(x, y, "#123456")
    ax.title, ax.xlabel, ax.ylabel = "a <title> & more", "x", "y"
    root = ET.fromstring(fig.svg(title="t"))  # parses: the text is escaped
    assert "a <title> & more" in [t.text for t in root.iter(f"{NS}text")]
    lines = [p for p in root.iter(f"{NS}polyline") if p.get("stroke") == "#123456"]
    assert [len(p.get("points").split()) for p in lines] == [7, 12]
    px0, py0, w, h = frame_of(root)
    (xlo, xhi), (ylo, yhi) = ax.x.limits, ax.y.limits
    drawn = np.array([[float(v) for v in point.split(",")] for p in lines for point in p.get("points").split()])
    back_x = xlo + (drawn[:, 0] - px0) / w * (xhi - xlo)
    back_y = ylo + (py0 + h - drawn[:, 1]) / h * (yhi - ylo)
    keep = ~np.isnan(y)
    assert np.allclose(back_x, x[keep], atol=0.16 * (xhi - xlo) / w)  # the point and the frame each rounded to 0.1 px
    assert np.allclose(back_y, y[keep], atol=0.16 * (yhi - ylo) / h)


@pytest.mark.parametrize("corner", range(4))  # the one corner left empty: bit 0 the left half, bit 1 the lower
def test_the_legend_goes_to_the_emptiest_corner(seed, corner):
    rng = np.random.default_rng(seed)
    fig = Figure(600, 300)
    ax = fig.axes[0][0]
    ax.x.limits = ax.y.limits = (0.0, 10.0)
    x, y = rng.uniform(0, 10, 400), rng.uniform(0, 10, 400)
    keep = ((x < 5) != bool(corner & 1)) | ((y < 5) != bool(corner & 2))
    ax.points(x[keep], y[keep], "#111111", label="everywhere but one corner")
    root = ET.fromstring(fig.svg())
    box = next(r for r in root.iter(f"{NS}rect") if r.get("stroke") == "#ccc")
    left, top = float(box.get("x")), float(box.get("y"))
    right, bottom = left + float(box.get("width")), top + float(box.get("height"))
    dots = [(float(c.get("cx")), float(c.get("cy"))) for c in root.iter(f"{NS}circle")
            if c.get("fill") == "#111111" and c.get("r") == "3.0"]  # (the legend's own key has r 3.5)
    assert len(dots) == keep.sum()
    assert not [d for d in dots if left <= d[0] <= right and top <= d[1] <= bottom]  # covers none of them
    assert fig.svg() == fig.svg()  # no ids, no clock: the same bytes again
