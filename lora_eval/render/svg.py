"""SVG charts for the reports, written as text: panels with linear or log axes holding lines, bands, bars, step
outlines, points, error bars and reference lines, with ticks, titles and legends.

Our own code rather than matplotlib because the reports are drawn inside the command, where matplotlib's import,
layout and ticks would cost a large share of a GPU run's forward and these take milliseconds (BENCHMARKS-history 15
and 18.3). The same data give the same bytes (no clock, no ids, coordinates rounded to 0.1 px). Text widths are
estimated from the character count, so margins fit labels without a font engine.
"""

from __future__ import annotations

import html
import math

import numpy as np

FONT = 11  # px, tick labels, legends
CHAR = 0.58  # average glyph width of a sans-serif font, in units of its size (for margins)
FAMILY = "DejaVu Sans, Helvetica, Arial, sans-serif"
GRID = "#e5e5e5"


def _f(value: float) -> str:
    """A coordinate: 0.1 px, no trailing zeros."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _attr(name: str, value) -> str:
    return f' {name}="{_esc(value)}"'


def _line(x1: float, y1: float, x2: float, y2: float, color: str, more: str = "") -> str:
    """A line from (x1, y1) to (x2, y2); `more`: further attributes (with their leading space)."""
    return f'<line x1="{_f(x1)}" y1="{_f(y1)}" x2="{_f(x2)}" y2="{_f(y2)}" stroke="{color}"{more}/>'


def text_width(text: str, size: float = FONT) -> float:
    return len(str(text)) * size * CHAR


def nice_ticks(lo: float, hi: float, count: int = 6, integer: bool = False) -> list[float]:
    """Round tick values inside [lo, hi], about `count` of them, steps of 1, 2, 2.5 or 5 x 10^k (whole numbers
    only with `integer`)."""
    lo, hi = min(lo, hi), max(lo, hi)
    raw = (hi - lo) / max(count - 1, 1)
    if not raw > 0:
        return [lo]
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw * 0.999)
    if integer:
        step = max(1.0, float(math.ceil(step)))
    first = math.ceil(lo / step - 1e-9)
    digits = max(0, -math.floor(math.log10(step)) + 1)
    return [round(k * step, digits) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def tick_label(value: float) -> str:
    """Whole numbers with thousands separators, others in 4 significant digits."""
    if value == int(value) and abs(value) < 1e12:
        return f"{int(value):,}"
    return f"{value:.4g}"


def log_label(exponent: int) -> str:
    return f"{10.0 ** exponent:g}" if -2 <= exponent <= 3 else f"1e{exponent}"


class Scale:
    """One axis: limits (lo maps to the start of the pixel span, hi to its end; lo > hi turns it round), linear
    or log10, and its ticks (automatic, or given positions and labels)."""

    def __init__(self, log: bool = False):
        self.log = log
        self.limits: tuple[float, float] | None = None
        self.ticks: tuple[list[float], list[str]] | None = None
        self.integer = False
        self.values: list[np.ndarray] = []  # the data's extents (finite, and positive ones), for automatic limits

    def add(self, *arrays) -> None:
        for a in arrays:
            a = np.asarray(a, dtype=np.float64).ravel()
            a = a[np.isfinite(a)]
            positive = a[a > 0]
            if a.size:
                self.values.append(np.array([a.min(), a.max()]))
            if positive.size:
                self.values.append(np.array([positive.min(), positive.max()]))

    def resolve(self) -> None:
        if self.limits is not None:
            return
        data = np.concatenate(self.values) if self.values else np.array([])
        if self.log:
            data = data[data > 0]
            # whole decades, with room where the data sit on one's edge
            lo, hi = ((math.floor(math.log10(data.min()) - 0.1), math.ceil(math.log10(data.max()) + 0.1))
                      if data.size else (0, 1))
            self.limits = (10.0 ** lo, 10.0 ** max(hi, lo + 1))
            return
        lo, hi = (float(data.min()), float(data.max())) if data.size else (0.0, 1.0)
        pad = (hi - lo) * 0.05 if hi > lo else max(abs(lo) * 0.1, 1.0)
        self.limits = (lo - pad, hi + pad)

    def fraction(self, values) -> np.ndarray:
        """Where values fall between the limits, 0..1 (log axes: values <= 0 become NaN)."""
        lo, hi = self.limits
        v = np.asarray(values, dtype=np.float64)
        if self.log:
            with np.errstate(divide="ignore", invalid="ignore"):
                v = np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
            lo, hi = math.log10(lo), math.log10(hi)
        return (v - lo) / (hi - lo)

    def tick_marks(self) -> tuple[list[float], list[str]]:
        if self.ticks is not None:
            return self.ticks
        lo, hi = self.limits
        if self.log:
            a, b = sorted((round(math.log10(lo)), round(math.log10(hi))))
            every = max(1, math.ceil((b - a + 1) / 8))
            exponents = [k for k in range(a, b + 1) if (k - a) % every == 0]
            return [10.0 ** k for k in exponents], [log_label(k) for k in exponents]
        values = nice_ticks(lo, hi, integer=self.integer)
        return values, [tick_label(v) for v in values]


class Axes:
    """A panel: what is drawn in data coordinates, its two scales, title, axis labels and legend entries."""

    def __init__(self, xlog: bool = False, ylog: bool = False):
        self.x, self.y = Scale(xlog), Scale(ylog)
        self.items: list[tuple] = []
        self.legend: list[tuple[str, str, str]] = []  # (label, color, kind: line, box, point, triangle, dashed)
        self.title = self.xlabel = self.ylabel = ""
        self.show_yticks = True
        self.slanted_xticks = False  # x tick labels at 30 degrees (long category names)

    def _label(self, label, color, kind):
        if label:
            self.legend.append((label, color, kind))

    def line(self, x, y, color, width=1.2, dash=None, label=None, markers=False):
        """A polyline, broken where x or y is not finite (or not positive on a log axis)."""
        self.x.add(x), self.y.add(y)
        self.items.append(("line", np.asarray(x, float), np.asarray(y, float), color, width, dash, markers))
        self._label(label, color, "dashed" if dash else "line")

    def band(self, x, lo, hi, color, opacity=0.2):
        self.x.add(x), self.y.add(lo, hi)
        self.items.append(("band", np.asarray(x, float), np.asarray(lo, float), np.asarray(hi, float), color,
                           opacity))

    def bars(self, left, right, top, color, bottom=None, opacity=1.0, label=None):
        """Rectangles from `bottom` (the axis's lower end when None) up to `top`."""
        self.x.add(left, right), self.y.add(top, *([] if bottom is None else [bottom]))
        self.items.append(("bars", np.asarray(left, float), np.asarray(right, float), np.asarray(top, float),
                           None if bottom is None else np.asarray(bottom, float), color, opacity))
        self._label(label, color, "box")

    def steps(self, edges, counts, color, width=1.5, label=None):
        """A histogram's outline: counts[i] over [edges[i], edges[i+1]] (counts of 0 drop to the axis)."""
        edges, counts = np.asarray(edges, float), np.asarray(counts, float)
        self.x.add(edges), self.y.add(counts)
        self.items.append(("steps", edges, counts, color, width))
        self._label(label, color, "line")

    def points(self, x, y, color, size=3.0, marker="circle", label=None, opacity=0.85):
        self.x.add(x), self.y.add(y)
        self.items.append(("points", np.asarray(x, float), np.asarray(y, float), color, size, marker, opacity))
        self._label(label, color, "triangle" if marker == "triangle" else "point")

    def errorbars(self, x, y, xlo, xhi, color, label=None):
        """Points at (x, y) with horizontal bars from xlo to xhi."""
        self.x.add(x, xlo, xhi), self.y.add(y)
        self.items.append(("errorbars", np.asarray(x, float), np.asarray(y, float), np.asarray(xlo, float),
                           np.asarray(xhi, float), color))
        self._label(label, color, "point")

    def hline(self, y, color, width=0.8, dash=None, label=None):
        self.y.add([y])
        self.items.append(("hline", float(y), color, width, dash))
        self._label(label, color, "dashed" if dash else "line")

    def vline(self, x, color, width=0.8, dash=None, label=None):
        self.x.add([x])
        self.items.append(("vline", float(x), color, width, dash))
        self._label(label, color, "dashed" if dash else "line")

    # ---- drawing ---------------------------------------------------------------------------------------

    def margins(self) -> tuple[float, float, float, float]:
        """(left, right, top, bottom) pixels around the plot area for the labels."""
        self.x.resolve(), self.y.resolve()
        ylabels = self.y.tick_marks()[1] if self.show_yticks else []
        size = self.ytick_size()
        left = max([text_width(t, size) for t in ylabels] + [0]) + 10 + (FONT + 8 if self.ylabel else 0)
        xlabels = self.x.tick_marks()[1]
        rise = max([text_width(t) for t in xlabels] + [0]) * 0.5 if self.slanted_xticks else 0
        bottom = FONT + 10 + rise + (FONT + 8 if self.xlabel else 0)
        top = FONT + 12 if self.title else 8
        return left, 12, top, bottom

    def ytick_size(self) -> float:
        return FONT if len(self.y.tick_marks()[0]) <= 30 else 8

    def draw(self, x0: float, y0: float, w: float, h: float) -> list[str]:
        """SVG elements of the panel whose plot area is (x0, y0, w, h) in pixels."""
        def px(v):
            return x0 + self.x.fraction(v) * w

        def py(v):
            return y0 + h - self.y.fraction(v) * h

        left, _, _, bottom = self.margins()
        out = []
        for value, label in zip(*self.x.tick_marks()):
            x = float(px(value))
            out.append(_line(x, y0, x, y0 + h, GRID))
            if self.slanted_xticks:
                out.append(f'<text x="{_f(x)}" y="{_f(y0 + h + 12)}" text-anchor="end" transform="rotate(-30 '
                           f'{_f(x)} {_f(y0 + h + 12)})">{_esc(label)}</text>')
            else:
                out.append(f'<text x="{_f(x)}" y="{_f(y0 + h + FONT + 4)}" text-anchor="middle">{_esc(label)}</text>')
        size = self.ytick_size()
        for value, label in zip(*self.y.tick_marks()):
            y = float(py(value))
            out.append(_line(x0, y, x0 + w, y, GRID))
            if self.show_yticks:
                out.append(f'<text x="{_f(x0 - 5)}" y="{_f(y + size * 0.35)}" text-anchor="end"'
                           f'{"" if size == FONT else _attr("font-size", size)}>{_esc(label)}</text>')
        for item in self.items:
            out += getattr(self, f"_draw_{item[0]}")(px, py, x0, y0, w, h, *item[1:])
        out.append(f'<rect x="{_f(x0)}" y="{_f(y0)}" width="{_f(w)}" height="{_f(h)}" fill="none" stroke="#444"/>')
        if self.title:
            out.append(f'<text x="{_f(x0)}" y="{_f(y0 - 6)}" font-size="{FONT + 1}">{_esc(self.title)}</text>')
        if self.xlabel:
            out.append(f'<text x="{_f(x0 + w / 2)}" y="{_f(y0 + h + bottom - 8)}" text-anchor="middle">'
                       f'{_esc(self.xlabel)}</text>')
        if self.ylabel:
            x = x0 - left + FONT
            out.append(f'<text x="{_f(x)}" y="{_f(y0 + h / 2)}" text-anchor="middle" transform="rotate(-90 {_f(x)} '
                       f'{_f(y0 + h / 2)})">{_esc(self.ylabel)}</text>')
        if self.legend:
            width, height = max(text_width(label) for label, _, _ in self.legend) + 34, len(self.legend) * 16 + 6
            left, top = self._legend_corner(px, py, (x0 + 6, x0 + w - width - 6), (y0 + 6, y0 + h - height - 6),
                                            width, height)
            out.append(f'<rect x="{_f(left)}" y="{_f(top)}" width="{_f(width)}" height="{_f(height)}" '
                       'fill="white" fill-opacity="0.85" stroke="#ccc"/>')
            out += legend_entries(self.legend, left + 6, top + 14, vertical=True)
        return out

    def _legend_corner(self, px, py, lefts, tops, width, height) -> tuple[float, float]:
        """The corner of the plot area where a legend box covers the fewest drawn points (top right on ties)."""
        xs, ys = [], []
        for kind, *data in self.items:
            if kind in ("line", "points", "errorbars"):
                xs.append(px(data[0])), ys.append(py(data[1]))
            elif kind == "band":
                xs += [px(data[0])] * 2
                ys += [py(data[1]), py(data[2])]
            elif kind in ("bars", "steps"):  # a bar's top and points down its middle
                if kind == "bars":
                    mid, top = (px(data[0]) + px(data[1])) / 2, py(data[2])
                else:
                    mid, top = (px(data[0][:-1]) + px(data[0][1:])) / 2, py(data[1])
                for share in np.linspace(0, 1, 8):
                    xs.append(mid), ys.append(top + share * (tops[1] + height + 6 - top))
            elif kind in ("hline", "vline"):
                line = np.linspace(0, 1, 40)
                at = np.full(40, float(py(data[0]) if kind == "hline" else px(data[0])))
                ends = lefts if kind == "hline" else tops
                along = ends[0] + line * (ends[1] + (width if kind == "hline" else height) - ends[0])
                xs.append(along if kind == "hline" else at), ys.append(at if kind == "hline" else along)
        x = np.concatenate(xs) if xs else np.array([])
        y = np.concatenate(ys) if ys else np.array([])
        corners = [(lefts[1], tops[0]), (lefts[0], tops[0]), (lefts[1], tops[1]), (lefts[0], tops[1])]
        covered = [int(((x >= a) & (x <= a + width) & (y >= b) & (y <= b + height)).sum()) for a, b in corners]
        return corners[covered.index(min(covered))]

    @staticmethod
    def _dash(dash) -> str:
        return _attr("stroke-dasharray", dash) if dash else ""

    def _draw_line(self, px, py, x0, y0, w, h, x, y, color, width, dash, markers):
        xs, ys = px(x), py(y)
        ok = np.isfinite(xs) & np.isfinite(ys)
        out, run = [], []
        for i in range(len(xs) + 1):
            if i < len(xs) and ok[i]:
                run.append(f"{_f(xs[i])},{_f(ys[i])}")
                continue
            if len(run) > 1:
                out.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" stroke-width="{width}"'
                           f'{self._dash(dash)}/>')
            run = []
        if markers:
            out += [f'<circle cx="{_f(a)}" cy="{_f(b)}" r="2.5" fill="{color}"/>' for a, b in zip(xs[ok], ys[ok])]
        return out

    def _draw_band(self, px, py, x0, y0, w, h, x, lo, hi, color, opacity):
        xs, los, his = px(x), py(lo), py(hi)
        ok = np.isfinite(xs) & np.isfinite(los) & np.isfinite(his)
        if ok.sum() < 2:
            return []
        upper = [f"{_f(a)},{_f(b)}" for a, b in zip(xs[ok], his[ok])]
        lower = [f"{_f(a)},{_f(b)}" for a, b in zip(xs[ok][::-1], los[ok][::-1])]
        return [f'<polygon points="{" ".join(upper + lower)}" fill="{color}" fill-opacity="{opacity}"/>']

    def _draw_bars(self, px, py, x0, y0, w, h, left, right, top, bottom, color, opacity):
        xl, xr, yt = px(left), px(right), py(top)
        yb = np.full_like(yt, y0 + h) if bottom is None else py(bottom)
        out = []
        for a, b, t, u in zip(xl, xr, yt, yb):
            if np.isfinite([a, b, t, u]).all() and u > t:
                out.append(f'<rect x="{_f(a)}" y="{_f(t)}" width="{_f(b - a)}" height="{_f(u - t)}" fill="{color}"'
                           f'{"" if opacity == 1 else _attr("fill-opacity", opacity)}/>')
        return out

    def _draw_steps(self, px, py, x0, y0, w, h, edges, counts, color, width):
        xs, ys = px(edges), py(counts)
        base = y0 + h
        ys = np.where(np.isfinite(ys), ys, base)  # a zero count on a log axis: down to the axis
        pts = [f"{_f(xs[0])},{_f(base)}"]
        for i, y in enumerate(ys):
            pts += [f"{_f(xs[i])},{_f(y)}", f"{_f(xs[i + 1])},{_f(y)}"]
        pts.append(f"{_f(xs[-1])},{_f(base)}")
        return [f'<polyline points="{" ".join(pts)}" fill="none" stroke="{color}" stroke-width="{width}"/>']

    def _draw_points(self, px, py, x0, y0, w, h, x, y, color, size, marker, opacity):
        xs, ys = px(x), py(y)
        ok = np.isfinite(xs) & np.isfinite(ys)
        if marker == "triangle":
            return [f'<polygon points="{_f(a - size)},{_f(b - size)} {_f(a + size)},{_f(b - size)} {_f(a)},'
                    f'{_f(b + size)}" fill="{color}"/>' for a, b in zip(xs[ok], ys[ok])]
        return [f'<circle cx="{_f(a)}" cy="{_f(b)}" r="{size}" fill="{color}" fill-opacity="{opacity}"/>'
                for a, b in zip(xs[ok], ys[ok])]

    def _draw_errorbars(self, px, py, x0, y0, w, h, x, y, xlo, xhi, color):
        out = []
        for a, b, lo, hi in zip(px(x), py(y), px(xlo), px(xhi)):
            if np.isfinite([lo, hi, b]).all():
                out.append(_line(lo, b, hi, b, color))
            if np.isfinite([a, b]).all():
                out.append(f'<circle cx="{_f(a)}" cy="{_f(b)}" r="3" fill="{color}"/>')
        return out

    def _draw_hline(self, px, py, x0, y0, w, h, y, color, width, dash):
        b = float(py(y))
        return [_line(x0, b, x0 + w, b, color, f' stroke-width="{width}"{self._dash(dash)}')] \
            if math.isfinite(b) else []

    def _draw_vline(self, px, py, x0, y0, w, h, x, color, width, dash):
        a = float(px(x))
        return [_line(a, y0, a, y0 + h, color, f' stroke-width="{width}"{self._dash(dash)}')] \
            if math.isfinite(a) else []


def legend_entries(entries, x: float, y: float, vertical: bool) -> list[str]:
    """Legend keys and labels from (x, y), one under another or side by side."""
    out = []
    for label, color, kind in entries:
        if kind in ("line", "dashed"):
            dash = ' stroke-dasharray="5 3"' if kind == "dashed" else ""
            out.append(_line(x, y - 4, x + 18, y - 4, color, f' stroke-width="2"{dash}'))
        elif kind == "box":
            out.append(f'<rect x="{_f(x + 3)}" y="{_f(y - 9)}" width="12" height="10" fill="{color}"/>')
        elif kind == "triangle":
            out.append(f'<polygon points="{_f(x + 5)},{_f(y - 8)} {_f(x + 13)},{_f(y - 8)} {_f(x + 9)},{_f(y)}" '
                       f'fill="{color}"/>')
        else:
            out.append(f'<circle cx="{_f(x + 9)}" cy="{_f(y - 4)}" r="3.5" fill="{color}"/>')
        out.append(f'<text x="{_f(x + 24)}" y="{_f(y)}">{_esc(label)}</text>')
        if vertical:
            y += 16
        else:
            x += text_width(label) + 40
    return out


class Figure:
    """A grid of panels (`rows` x `cols`, each row's height a share of the figure's), optionally a legend line
    above them; `svg()` writes it. Jupyter shows it inline (`_repr_svg_`)."""

    def __init__(self, width: float, height: float, rows: int = 1, cols: int = 1, xlog: bool = False,
                 ylog: bool = False, heights: list[float] | None = None):
        self.width, self.height = float(width), float(height)
        self.axes = [[Axes(xlog, ylog) for _ in range(cols)] for _ in range(rows)]
        self.heights = heights or [1.0] * rows
        self.legend: list[tuple[str, str, str]] = []

    def svg(self, title: str = "", standalone: bool = True) -> str:
        """The figure as an <svg> element: `standalone` adds the XML namespace a .svg file needs (HTML does not);
        `title` is its accessible name."""
        margins = [[a.margins() for a in row] for row in self.axes]
        _, right, top, bottom = (max(m) for m in zip(*(m for row in margins for m in row)))
        lefts = [max(m[0] for m in column) for column in zip(*margins)]  # each column fits its own labels
        head = 24 if self.legend else 0
        rows, cols = len(self.axes), len(self.axes[0])
        plot_w = (self.width - 10 - sum(lefts) - cols * right) / cols
        free = self.height - head - rows * (top + bottom)
        body = [f'<rect width="{_f(self.width)}" height="{_f(self.height)}" fill="white"/>']
        if self.legend:
            width = sum(text_width(label) + 40 for label, _, _ in self.legend)
            body += legend_entries(self.legend, max((self.width - width) / 2, 4), 17, vertical=False)
        y = head
        for row, share in zip(self.axes, self.heights):
            h = free * share / sum(self.heights)
            x = 5.0
            for axes, left in zip(row, lefts):
                body += axes.draw(x + left, y + top, plot_w, h)
                x += left + plot_w + right
            y += top + h + bottom
        namespace = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
        name = f'<title>{_esc(title)}</title>' if title else ""
        return (f'<svg{namespace} width="{_f(self.width)}" height="{_f(self.height)}" viewBox="0 0 {_f(self.width)} '
                f'{_f(self.height)}" font-family="{FAMILY}" font-size="{FONT}" role="img"'
                f'{_attr("aria-label", title) if title else ""}>{name}\n' + "\n".join(body)
                + "\n</svg>\n")

    def _repr_svg_(self) -> str:
        return self.svg()
