"""fetch-images decodes by the one image rule set of every source: the same file served by URL
becomes the same JPEG as through a folder source, and what cannot be used is counted under
its real reason (not `fetch_error`, which `sdpipe refetch` would download again)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.latents import images
from tasks.sources import fetch_images
from tests.tasks import bad_images as bad
from tests.tasks.fixtures_archives import http_mirror, members

SIZE, MIN_SIDE = 64, 32
ARROW = np.zeros((96, 80, 3), np.uint8)
ARROW[:48] = bad.RED  # the top half red, as displayed


def test_url_images_follow_the_rules_of_every_source(tmp_path):
    files = {
        "exif6.jpg": bad.exif_rotated_jpeg(ARROW, 6),
        "exif3.jpg": bad.exif_rotated_jpeg(ARROW, 3),
        "gray16.png": bad.gray16_png(level=200),
        "rgb16.png": bad.png16(color=bad.GREEN),
        "rgba.png": bad.rgba_png(alpha=0),
        "cmyk.jpg": bad.cmyk_jpeg(),
        "plain.jpg": bad.jpeg(),
        "zero.jpg": bad.zero_bytes(),
        "bomb.png": bad.png_bomb(),
        "truncated.jpg": bad.truncated_jpeg(),
        "small.jpg": bad.tiny_jpeg(16),
        "html.jpg": bad.not_an_image(),
    }
    expected_drops = {
        "zero.jpg": "decode_error",
        "bomb.png": "too_large",
        "truncated.jpg": "truncated",
        "small.jpg": "too_small",
        "html.jpg": "decode_error",
    }
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name, data in files.items():
        (mirror / name).write_bytes(data)
    names = sorted(files)
    keys = [f"00000{i:07d}" for i in range(len(names))]
    root = tmp_path / "data"
    (root / "src" / "filtered").mkdir(parents=True)
    with http_mirror(mirror) as url:
        rows = pa.table(
            {
                "key": keys,
                "url": [f"{url}/{n}" for n in names],
                "caption": [f"a {n}" for n in names],
            }
        )
        pq.write_table(rows, root / "src" / "filtered" / "00000.parquet")
        stats = fetch_images.fetch_images_shard(
            root,
            "src",
            "00000",
            image_size=SIZE,
            min_side=MIN_SIDE,
            thread_count=4,
            allow_private_hosts=True,  # served on 127.0.0.1
        )

    table = pq.read_table(root / "src" / "shards" / "00000.parquet").to_pylist()
    status = {names[keys.index(r["key"])]: r["status"] for r in table}
    assert {n: s for n, s in status.items() if s != "success"} == expected_drops
    assert stats.dropped == {"decode_error": 2, "too_large": 1, "truncated": 1, "too_small": 1}
    assert stats.num_out == len(files) - len(expected_drops)

    tar = members(root / "src" / "shards" / "00000.tar")
    for name, key in zip(names, keys, strict=True):
        if name in expected_drops:
            assert f"{key}.jpg" not in tar
            continue
        # Byte for byte what a folder source's repack writes for the same file.
        jpeg, width, height = images.repack_image(files[name], SIZE, min_side=MIN_SIDE)
        assert tar[f"{key}.jpg"] == jpeg, name
        row = next(r for r in table if r["key"] == key)
        assert (row["width"], row["height"]) == (width, height), name
    pixels = {
        n: images.decode_image(tar[f"{k}.jpg"], SIZE)
        for n, k in zip(names, keys, strict=True)
        if n not in expected_drops
    }
    for name in ("exif6.jpg", "exif3.jpg"):  # displayed upright: red on top
        top, bottom = pixels[name][: SIZE // 4], pixels[name][-SIZE // 4 :]
        assert top[..., 0].mean() > 150 and bottom[..., 0].mean() < 60, name
    assert np.abs(pixels["gray16.png"].astype(int) - 200).max() <= 3  # not all white
    assert np.abs(pixels["rgb16.png"].astype(int) - bad.GREEN).max() <= 6
    assert pixels["rgba.png"].min() >= 250  # transparent over white
    # The EXIF-rotated file's stored size is reported as displayed (portrait).
    exif_row = next(r for r in table if r["key"] == keys[names.index("exif6.jpg")])
    assert (exif_row["width"], exif_row["height"]) == (80, 96)
