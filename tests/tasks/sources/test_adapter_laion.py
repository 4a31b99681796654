"""LAION (a URL source): blocklist anti-join on ingest, img2dataset on loopback, and a refetch
of failed URLs that keeps every image already fetched."""

from __future__ import annotations

import re
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from catalog import FilterProfile, Source
from tasks.curation import filter as filter_stage
from tasks.curation import filter_pixels
from tasks.latents import tokenize
from tasks.runtime.shards import generation, stats_path
from tasks.sources import demo_source, fetch_images, metadata
from tests.tasks.fixtures_archives import members, read_dir

PROFILE = FilterProfile(name="loose", min_side=128, dedup=("url",))


@pytest.fixture
def mirror(tmp_path):
    mirror = demo_source.generate_mirror(tmp_path / "mirror", num_images=8, seed=3)
    part = mirror / "metadata" / "part-00000.parquet"
    table = pq.read_table(part)
    # LAION's WIDTH/HEIGHT may be NaN: such a row is not judged by declared size.
    width = table["WIDTH"].to_pylist()
    width[0] = float("nan")
    table = table.set_column(table.column_names.index("WIDTH"), "WIDTH", pa.array(width))
    pq.write_table(table, part)
    return mirror


def test_blocklist_fetch_and_refetch(tmp_path, mirror):
    upstream = pq.read_table(mirror / "metadata" / "part-00000.parquet").to_pylist()
    good = [r for r in upstream if "/images/0000" in r["URL"]]
    blocklist = tmp_path / "blocklist.parquet"
    pq.write_table(
        pa.table(
            {
                "url": [good[1]["URL"], "https://elsewhere.example/x.jpg"],
                "hash": [good[2]["hash"], 7],
            }
        ),
        blocklist,
    )
    blocked = {good[1]["URL"], good[2]["URL"]}
    src = Source(
        name="laion",
        kind="url",
        location=str(mirror / "metadata"),
        license="test",
        profile="loose",
        resolution=64,
        allow_private_hosts=True,  # the mirror is served on 127.0.0.1
        options={"blocklist": str(blocklist)},
    )
    root = tmp_path / "data"
    [location] = metadata.list_metadata_files(root, src)
    stats = metadata.fetch_metadata_shard(root, src, 0, location)
    n_blocked = sum(r["URL"] in blocked for r in upstream)  # a blocked URL may be listed twice
    assert stats.dropped == {"blocklist": n_blocked}
    assert stats.num_out == len(upstream) - n_blocked
    assert not blocked & set(read_dir(root / "laion" / "metadata")["url"].to_pylist())

    filter_stage.filter_metadata(root, "laion", PROFILE, 10_000)
    kw = dict(image_size=64, min_side=PROFILE.min_side, thread_count=4, allow_private_hosts=True)
    with demo_source.serve_mirror(mirror):
        fetched = fetch_images.fetch_images_shard(root, "laion", "00000", **kw)
    assert fetched.dropped["http_404"] == demo_source.PLANTED["http_404"]
    failed = fetch_images.failed_samples(root, "laion")
    assert failed.num_rows == fetched.extra["num_failed_urls"]  # a count: the URLs are in the table
    assert set(failed["status"].to_pylist()) >= {"http_404", "decode_error"}
    before = members(root / "laion" / "shards" / "00000.tar")

    # A refetch of transient failures finds none: a 404 is not retried by default.
    assert fetch_images.refetch_shard(root, "laion", "00000", **kw) is None
    # The missing images come back upstream; a downstream record exists and goes stale.
    for i in range(demo_source.PLANTED["http_404"]):
        shutil.copy(mirror / "images" / "00000.jpg", mirror / "images" / f"missing-{i}.jpg")
    tokens_record = stats_path(root, "laion", "tokens", "00000")
    tokens_record.parent.mkdir(parents=True)
    tokens_record.write_text("{}")
    with demo_source.serve_mirror(mirror):
        again = fetch_images.refetch_shard(
            root, "laion", "00000", reasons=re.compile("http_404"), **kw
        )
    assert again.extra["refetched"] == demo_source.PLANTED["http_404"]
    assert "http_404" not in again.dropped
    assert again.num_out == fetched.num_out + demo_source.PLANTED["http_404"]
    assert again.num_in == fetched.num_in
    after = members(root / "laion" / "shards" / "00000.tar")
    assert {k: v for k, v in after.items() if k in before} == before  # kept byte for byte
    assert len(after) == len(before) + 3 * demo_source.PLANTED["http_404"]
    table = pq.read_table(root / "laion" / "shards" / "00000.parquet")
    ok = table.filter(pc.equal(table["status"], "success"))
    assert {f"{k}.jpg" for k in ok["key"].to_pylist()} == {n for n in after if n.endswith(".jpg")}
    assert not tokens_record.exists()
    assert generation(root, "laion") == 1

    # ... and on to tokens, as build-latents goes on: every sample accounted for.
    selected = filter_pixels.select_pixels(root, "laion", PROFILE)
    assert selected.num_in == again.num_out  # every fetched image is judged
    assert selected.num_in == selected.num_out + sum(selected.dropped.values())
    tokens = tokenize.tokenize_shard(root, "laion", "00000")
    assert tokens.num_in == selected.num_out
    assert tokens.num_in == tokens.num_out + sum(tokens.dropped.values())
    ids = pq.read_table(root / "laion" / "tokens" / "00000.parquet")
    kept = pq.read_table(root / "laion" / "selected" / "00000.parquet")
    assert ids["key"].to_pylist() == kept["key"].to_pylist()
    assert ids["input_ids"].type.list_size == 77


def test_a_blocklist_without_url_or_hash_is_one_clear_line(tmp_path, mirror):
    bad = tmp_path / "bl.parquet"
    pq.write_table(pa.table({"link": ["x"]}), bad)
    src = Source(
        name="laion",
        kind="url",
        location=str(mirror / "metadata"),
        license="t",
        profile="loose",
        options={"blocklist": str(bad)},
    )
    [location] = metadata.list_metadata_files(tmp_path, src)
    with pytest.raises(
        metadata.SourceError, match=r"needs a `url` or `hash` column; found \['link'\]"
    ):
        metadata.fetch_metadata_shard(tmp_path, src, 0, location)


def test_rows_without_a_url_are_dropped_on_ingest(tmp_path):
    # Null, empty and whitespace-only URLs are counted as missing_url by the metadata stage, so
    # no filter profile has to read every URL again; what merely starts oddly is kept.
    urls = {
        "null": None,
        "empty": "",
        "spaces": "   ",
        "tab": "\t",
        "newlines": " \r\n",
        "leading_space": " http://x/a.jpg",
        "bang": "!x",
        "accent": "\u00e9t\u00e9.jpg",
        "plain": "http://x/b.jpg",
    }
    upstream = tmp_path / "up"
    upstream.mkdir()
    pq.write_table(
        pa.table({"URL": list(urls.values()), "TEXT": list(urls), "WIDTH": [600.0] * len(urls)}),
        upstream / "part-0.parquet",
    )
    src = Source(name="laion", kind="url", location=str(upstream), license="t", profile="loose")
    root = tmp_path / "data"
    [location] = metadata.list_metadata_files(root, src)
    stats = metadata.fetch_metadata_shard(root, src, 0, location)
    # What is there but is no http(s) URL as written is counted apart.
    assert stats.dropped == {"missing_url": 5, "bad_url_scheme": 3}
    assert (stats.num_in, stats.num_out) == (len(urls), 1)
    kept = read_dir(root / "laion" / "metadata")
    assert kept["caption"].to_pylist() == ["plain"]
    assert kept["url"].to_pylist() == [urls["plain"]]


def test_only_http_urls_of_public_hosts_are_fetched(tmp_path):
    # img2dataset reads file:// URLs from the local disk and fetches whatever host a row names:
    # on ingest, anything but http(s) is refused, and so are hosts that are this machine or a
    # private network (in any notation the resolver accepts) unless the source allows them.
    public = [
        "http://x.org/a.jpg",
        "HTTPS://Example.COM/b.png",
        "http://8.8.8.8/c.jpg",
        "http://user:pw@x.org/d.jpg",
        "http://[2001:4860::1]/e.jpg",
        "http://172.40.0.1/f",
    ]
    bad_scheme = [
        "file:///etc/passwd",
        "ftp://x.org/a.jpg",
        "//x.org/a.jpg",
        "x.org/a.jpg",
        "data:image/png;base64,AAAA",
        "http:///a.jpg",
        "javascript:alert(1)",
    ]
    private = ["http://127.0.0.1:8000/a.jpg", "http://localhost/a.jpg", "http://2130706433/a",
               "http://0x7f000001/a", "http://[::1]/a", "http://u@10.1.2.3/a",
               "http://192.168.1.1/a", "http://img.localhost/a", "http://169.254.169.254/x",
               "http://172.20.0.1/x", "http://[fd00::1]/x", "http://0.0.0.0/x"]  # fmt: skip
    urls = public + bad_scheme + private
    upstream = tmp_path / "up"
    upstream.mkdir()
    pq.write_table(
        pa.table({"URL": urls, "TEXT": [f"c{i}" for i in range(len(urls))]}),
        upstream / "part-0.parquet",
    )
    for allow, kept in ((False, public), (True, public + private)):
        src = Source(
            name="laion",
            kind="url",
            location=str(upstream),
            license="t",
            profile="loose",
            allow_private_hosts=allow,
        )
        root = tmp_path / f"data-{allow}"
        [location] = metadata.list_metadata_files(root, src)
        stats = metadata.fetch_metadata_shard(root, src, 0, location)
        expected = {"bad_url_scheme": len(bad_scheme)}
        if not allow:
            expected["private_host"] = len(private)
        assert stats.dropped == expected
        assert read_dir(root / "laion" / "metadata")["url"].to_pylist() == kept
