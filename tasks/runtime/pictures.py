"""Pictures for the dashboard and shared pages: JPEG data URIs, text made inert, PIL line charts.

Everything a page or artifact shows is embedded (`data:image/...;base64`): a browser opening it
fetches nothing from anyone, so a reviewer's address never reaches the hosts of rejected (NSFW,
blocklisted) rows. Text from the data (captions, URLs) is escaped so it can never become markup
that loads something. Charts are drawn with PIL, not matplotlib: one less heavy dependency.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from PIL import Image, ImageDraw, ImageFont

THUMB_SIDE = 112  # px, the longer side of a thumbnail in an artifact
THUMB_QUALITY = 70


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def jpeg_uri(image: Image.Image, *, side: int | None = None, quality: int = THUMB_QUALITY) -> str:
    """A JPEG data URI of `image`, shrunk (aspect kept) to fit `side` x `side` if given."""
    image = image.convert("RGB")
    if side is not None and max(image.size) > side:
        image = image.copy()
        image.thumbnail((side, side), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return data_uri(buf.getvalue(), "image/jpeg")


def png_uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return data_uri(buf.getvalue(), "image/png")


def fitted_jpeg_uri(image: Image.Image, *, max_width: int, max_chars: int) -> str:
    """A JPEG data URI at most `max_width` px wide and `max_chars` long: quality, then size,
    give way until it fits (a sample grid of a 512 px model is 2048 px wide as a PNG)."""
    image = image.convert("RGB")
    if image.width > max_width:
        image = image.resize(
            (max_width, max(1, round(image.height * max_width / image.width))),
            Image.Resampling.LANCZOS,
        )
    while True:
        for quality in (85, 70, 55):
            uri = jpeg_uri(image, quality=quality)
            if len(uri) <= max_chars:
                return uri
        if image.width <= 64:
            raise ValueError(f"no JPEG of this image fits in {max_chars} characters")
        image = image.resize((image.width // 2, max(1, image.height // 2)))


def url_domain(url: str) -> str:
    """The host a URL points at ('' when it has none), for showing where a row came from."""
    try:
        return urlsplit(url.strip()).hostname or ""
    except ValueError:  # e.g. a malformed IPv6 literal in scraped data
        return ""


# What can start markup inside a table cell; `:` too, so `http://` in a caption is no autolink.
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_\[\]()!#|~{}:])")


def md_text(text: object, *, limit: int = 240) -> str:
    """Text from the data as inert markdown: one line, HTML-escaped, markdown punctuation
    backslash-escaped (a caption `![x](http://...)` stays text), cut at `limit` characters."""
    s = " ".join(str(text).split())
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", html.escape(s, quote=False))


def md_code(text: object, *, limit: int = 200) -> str:
    """Text as an inline code span inside a table cell: never a link or an image."""
    s = " ".join(str(text).split()).replace("`", "'")
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return "`" + s.replace("|", "\\|") + "`"


# ---- charts -------------------------------------------------------------------------------------

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


@dataclass(kw_only=True, slots=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]
    dots: bool = False  # markers only (sparse points such as validation losses)


@dataclass(kw_only=True, slots=True)
class Panel:
    title: str
    series: list[Series] = field(default_factory=list)
    log_y: bool = False


def line_chart(panels: list[Panel], *, width: int = 720, panel_height: int = 220) -> Image.Image:
    """Panels stacked vertically, sharing no axes; each with its min / max ticks and legend."""
    font = ImageFont.load_default(size=12)
    image = Image.new("RGB", (width, panel_height * len(panels)), "white")
    draw = ImageDraw.Draw(image)
    for i, panel in enumerate(panels):
        _draw_panel(draw, font, panel, (0, i * panel_height, width, (i + 1) * panel_height))
    return image


def _draw_panel(draw: ImageDraw.ImageDraw, font, panel: Panel, box) -> None:
    x0, y0, x1, y1 = box
    left, right, top, bottom = x0 + 70, x1 - 12, y0 + 26, y1 - 28
    draw.text((x0 + 8, y0 + 6), panel.title, fill="black", font=font)
    points = [
        (x, y)
        for s in panel.series
        for x, y in s.points
        if math.isfinite(y) and (y > 0 or not panel.log_y)
    ]
    draw.rectangle((left, top, right, bottom), outline="#888")
    if not points:
        draw.text((left + 8, top + 8), "no data yet", fill="#888", font=font)
        return

    def fy(y: float) -> float:
        return math.log10(y) if panel.log_y else y

    xs, ys = [p[0] for p in points], [fy(p[1]) for p in points]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    pad = 0.05 * (y_hi - y_lo)
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def at(x: float, y: float) -> tuple[float, float]:
        px = left + (x - x_lo) / (x_hi - x_lo) * (right - left)
        py = bottom - (fy(y) - y_lo) / (y_hi - y_lo) * (bottom - top)
        return px, py

    for value in (y_lo + pad, (y_lo + y_hi) / 2, y_hi - pad):  # the data's min, middle, max
        py = bottom - (value - y_lo) / (y_hi - y_lo) * (bottom - top)
        draw.line((left - 4, py, left, py), fill="#888")
        label = f"{10**value if panel.log_y else value:.3g}"
        draw.text((left - 6, py), label, fill="black", font=font, anchor="rm")
    for value, anchor in ((x_lo, "la"), ((x_lo + x_hi) / 2, "ma"), (x_hi, "ra")):
        px = left + (value - x_lo) / (x_hi - x_lo) * (right - left)
        draw.line((px, bottom, px, bottom + 4), fill="#888")
        draw.text((px, bottom + 6), f"{value:.0f}", fill="black", font=font, anchor=anchor)
    draw.text((x0 + 8, bottom + 6), "step", fill="#555", font=font)

    legend_x = right
    for color, s in reversed(list(zip(COLORS, panel.series, strict=False))):
        legend_x -= draw.textlength(s.name, font=font) + 24
        if s.dots:
            draw.ellipse((legend_x + 4, y0 + 10, legend_x + 10, y0 + 16), fill=color)
        else:
            draw.line((legend_x, y0 + 13, legend_x + 14, y0 + 13), fill=color, width=3)
        draw.text((legend_x + 18, y0 + 6), s.name, fill="black", font=font)
    for color, s in zip(COLORS, panel.series, strict=False):
        pts = [at(x, y) for x, y in s.points if math.isfinite(y) and (y > 0 or not panel.log_y)]
        if s.dots or len(pts) == 1:
            for px, py in pts:
                draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill=color)
        elif pts:
            draw.line(pts, fill=color, width=2)
