"""Makers of the awkward inputs archive and folder sources contain, as bytes or files.

Shared by the adapter tests (VGGFace2, COCO, DiffusionDB, JourneyDB): each maker returns what
an upstream copy could hold, small and generated, never downloaded. What the stages must do
with each (the reason it is counted under, or how it is decoded) is in `tasks.latents.images` and
`tasks.sources.adapters.base`; the comment on each maker says what it is expected to become.
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

RED, GREEN, BLUE, WHITE, BLACK = (220, 30, 30), (30, 200, 60), (40, 60, 220), (255,) * 3, (0,) * 3

# Captions that must be dropped (the index stage's caption reasons, via clean_caption).
EMPTY_CAPTION = ""
WHITESPACE_CAPTION = " \t\n  "
INVALID_UTF8_CAPTION = b"a photo of \xff\xfe a person"


def canvas(width: int, height: int, color=RED) -> np.ndarray:
    """RGB uint8 [height, width, 3] filled with `color`."""
    return np.full((height, width, 3), color, np.uint8)


def encode(rgb: np.ndarray, fmt: str = "JPEG", **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt, **({"quality": 92} if fmt == "JPEG" else {}) | save)
    return buf.getvalue()


def jpeg(width: int = 128, height: int = 128, color=RED) -> bytes:
    """A plain RGB JPEG (kept)."""
    return encode(canvas(width, height, color))


def jpeg_of(rgb: np.ndarray, quality: int = 92) -> bytes:
    return encode(rgb, quality=quality)


def tiny_jpeg(side: int = 16, color=RED) -> bytes:
    """A JPEG under any sensible size floor (`too_small` when the profile's min_side > side)."""
    return jpeg(side, side, color)


def truncated_jpeg(width: int = 128, height: int = 128) -> bytes:
    """A JPEG cut off inside its scan, no end marker (`truncated`)."""
    rng = np.random.default_rng(0)  # noise: the scan is long enough to cut in the middle
    data = jpeg_of(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return data[: len(data) // 2]


def not_an_image() -> bytes:
    """Bytes no decoder reads, under an image name (`decode_error`)."""
    return b"<html><body>404 Not Found</body></html>\n"


def rgba_png(width: int = 128, height: int = 128, color=RED, alpha: int = 0) -> bytes:
    """An RGBA PNG; with alpha 0 it is all transparent: composited over white (kept)."""
    rgba = np.dstack([canvas(width, height, color), np.full((height, width), alpha, np.uint8)])
    return encode(rgba, "PNG")


def png16(width: int = 128, height: int = 128, color=RED) -> bytes:
    """A 16-bit RGB PNG (kept: the high byte of each sample, i.e. `color`)."""
    bgr16 = (canvas(width, height, color)[:, :, ::-1].astype(np.uint16) * 257).copy()
    ok, data = cv2.imencode(".png", bgr16)
    assert ok
    return data.tobytes()


def gray16_png(width: int = 128, height: int = 128, level: int = 200) -> bytes:
    """A 16-bit grayscale PNG (kept, as gray RGB `level`; img2dataset made it all white)."""
    ok, data = cv2.imencode(".png", np.full((height, width), level * 257, np.uint16))
    assert ok
    return data.tobytes()


def zero_bytes() -> bytes:
    """An empty file served as an image (`decode_error`: not transient, never refetched)."""
    return b""


def png_bomb(side: int = 14_000) -> bytes:
    """A real decompression bomb: a gray PNG of side x side zeros (196M pixels at the default,
    over the 179M-pixel limit) in ~200 KB (`too_large`, judged from its header)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    packer = zlib.compressobj(9)
    row = bytes(side + 1)  # filter byte 0 + the row's samples
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def gray_jpeg(width: int = 128, height: int = 128, level: int = 128) -> bytes:
    """A single-channel JPEG (kept, as gray RGB)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((height, width), level, np.uint8), mode="L").save(buf, "JPEG")
    return buf.getvalue()


def cmyk_jpeg(width: int = 128, height: int = 128, cmyk=(0, 255, 255, 0)) -> bytes:
    """A CMYK JPEG (PIL writes Adobe-inverted samples; kept, converted to RGB: red here)."""
    buf = io.BytesIO()
    Image.new("CMYK", (width, height), cmyk).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def exif_rotated_jpeg(displayed: np.ndarray, orientation: int = 6) -> bytes:
    """A JPEG whose stored pixels, turned by its EXIF `orientation`, show `displayed`.

    6: stored turned 90 degrees counter-clockwise (the viewer turns it clockwise); 8: the
    other way; 3: upside down. Decoders that honor EXIF return `displayed` (the rule for JPEG).
    """
    stored = {6: np.rot90(displayed, 1), 8: np.rot90(displayed, -1), 3: np.rot90(displayed, 2)}
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(np.ascontiguousarray(stored[orientation]), exif=exif.tobytes())


def animated_gif(width: int = 128, height: int = 128, colors=(RED, GREEN, BLUE)) -> bytes:
    """A GIF with one frame per color (kept: the first frame)."""
    frames = [Image.fromarray(canvas(width, height, c)) for c in colors]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buf.getvalue()


# ---- archives ---------------------------------------------------------------------------------


def write_zip(path: Path, members: dict[str, bytes], *, stored: bool = False) -> Path:
    """A zip with these members, names written as given (`../x.jpg` and `/x.jpg` included:
    `ZipFile.writestr` with a `ZipInfo` does not sanitize them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    method = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=(2017, 1, 1, 0, 0, 0))
            info.compress_type = method
            zf.writestr(info, data)
    return path


def corrupt_zip_member(path: Path, member: str) -> None:
    """Damage one member's stored data in place (its CRC no longer matches: reading it fails,
    the other members still read): a member truncated or corrupted in transfer."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    data = bytearray(path.read_bytes())
    # local header: 30 bytes + name + extra, then the member's data
    name_len = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    middle = start + info.compress_size // 2
    for i in range(middle, min(middle + 16, start + info.compress_size)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def write_tar(path: Path, members: dict[str, bytes], *, compression: str = "") -> Path:
    """A tar with these members, names written as given (unsafe ones included); compression
    "gz" writes a .tgz."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, f"w:{compression}" if compression else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def truncate_file(path: Path, fraction: float = 0.5) -> None:
    """Cut a file (an archive) off after `fraction` of its bytes, as an interrupted download."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def files_outside(root: Path, *allowed: Path) -> list[Path]:
    """Files under `root`'s parent that lie neither under `root` nor under `allowed` (a test's
    check that nothing was written outside the data root, e.g. through `..` members)."""
    keep = [root.resolve(), *(a.resolve() for a in allowed)]
    return [
        p
        for p in root.resolve().parent.rglob("*")
        if p.is_file() and not any(p.is_relative_to(k) for k in keep)
    ]
