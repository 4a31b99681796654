"""What a browser would load to show a page or a markdown artifact: every image source in it.

Markdown is rendered as CommonMark with GFM tables and raw HTML allowed (the most permissive a
dashboard could be), then every src / srcset / poster attribute and CSS url() is collected.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

from markdown_it import MarkdownIt

LOADING_ATTRIBUTES = ("src", "srcset", "poster", "background", "data")
CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]+)")


class _Sources(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name in LOADING_ATTRIBUTES:
                self.sources.append(value.strip())
            if name == "style":
                self.sources += CSS_URL.findall(value)
            if tag == "link" and name == "href":
                self.sources.append(value.strip())

    def handle_data(self, data):
        if self.lasttag == "style":
            self.sources += CSS_URL.findall(data)


def html_sources(page: str) -> list[str]:
    parser = _Sources()
    parser.feed(page)
    return parser.sources


def markdown_sources(text: str) -> list[str]:
    return html_sources(MarkdownIt("commonmark", {"html": True}).enable("table").render(text))


def not_embedded(sources: list[str]) -> list[str]:
    """The sources a browser would fetch from somewhere (anything but an embedded image)."""
    return [s for s in sources if not s.startswith("data:image/")]
