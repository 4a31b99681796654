"""Pictures for the dashboard: text from the data stays text, grids fit their budget, charts show
their series."""

from __future__ import annotations

import base64
import io

import numpy as np
from markdown_it import MarkdownIt
from PIL import Image

from tasks.runtime import pictures
from tests.image_sources import markdown_sources


def _decode(uri: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))


def test_markdown_from_the_data_renders_as_the_same_text():
    caption = "![x](http://t.example/a.png) <img src=x> *bold* [link](http://y) `code` | cell"
    text = pictures.md_text(caption)
    rendered = MarkdownIt("commonmark", {"html": True}).render(text)
    assert markdown_sources(text) == []
    assert "<a " not in rendered and "<em>" not in rendered and "<code>" not in rendered
    # What the reader sees is the caption itself, as written.
    assert rendered.strip() == "<p>" + caption.replace("<", "&lt;").replace(">", "&gt;") + "</p>"
    assert pictures.md_code("http://t.example/a|b`c") == "`http://t.example/a\\|b'c`"
    assert pictures.url_domain("https://Images.Example.com:8080/a.jpg") == "images.example.com"
    assert pictures.url_domain("not a url") == ""


def test_a_large_grid_fits_its_budget_as_a_jpeg():
    rng = np.random.default_rng(0)
    grid = Image.fromarray(rng.integers(0, 256, (512, 2048, 3), dtype=np.uint8))  # 4 x 512 px
    uri = pictures.fitted_jpeg_uri(grid, max_width=1024, max_chars=200_000)
    assert uri.startswith("data:image/jpeg;base64,") and len(uri) <= 200_000
    image = _decode(uri)
    assert image.width <= 1024 and abs(image.width / image.height - 4) < 0.05


def test_a_chart_draws_each_series_in_its_colour():
    chart = pictures.line_chart(
        [
            pictures.Panel(
                title="loss",
                series=[
                    pictures.Series(name="train", points=[(s, 1 / s) for s in range(1, 50)]),
                    pictures.Series(name="val", points=[(10, 0.1), (40, 0.03)], dots=True),
                ],
            ),
            pictures.Panel(title="lr", series=[pictures.Series(name="lr", points=[])]),
        ],
        width=400,
        panel_height=150,
    )
    assert chart.size == (400, 300)
    pixels = {tuple(p) for p in np.asarray(chart)[:150].reshape(-1, 3)}
    for color in pictures.COLORS[:2]:
        assert tuple(int(color[i : i + 2], 16) for i in (1, 3, 5)) in pixels
    # The empty panel, below its legend, is its frame and "no data yet": grey only.
    below_legend = np.asarray(chart)[150 + 22 :].astype(int)
    assert (below_legend.max(axis=2) == below_legend.min(axis=2)).all()
    assert (below_legend < 200).any()
