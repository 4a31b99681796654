"""What image bytes say before they are decoded: the format (by magic bytes, not the name), a
truncated file, and the size from the header (a JPEG's SOF, PNG, GIF, WebP, BMP) where one is."""

from __future__ import annotations

_JPEG_SOS, _JPEG_EOI = b"\xff\xda", b"\xff\xd9"
_PNG_IEND = b"IEND\xaeB`\x82"  # the IEND chunk type and its (constant) CRC


def sniff(data: bytes) -> str:
    """The container format from the leading bytes (file names and extensions lie)."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return "other"


def is_truncated(data: bytes, fmt: str) -> bool:
    if fmt == "jpeg":
        # 0xFFD9 cannot occur inside entropy-coded data (0xFF is stuffed), and an EXIF
        # thumbnail's own EOI lies before the main image's last scan.
        end = data.rfind(_JPEG_EOI)
        return end < 0 or end < data.rfind(_JPEG_SOS)
    if fmt == "png":
        return _PNG_IEND not in data
    if fmt == "webp":
        return len(data) < 8 + int.from_bytes(data[4:8], "little")
    return False


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the JPEG frame header, without decoding; None if not found."""
    i, n = 2, len(data)
    while i + 9 < n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        # SOF0..SOF15, except DHT (C4), JPG (C8) and DAC (CC), carry the frame size.
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height = int.from_bytes(data[i + 5 : i + 7], "big")
            width = int.from_bytes(data[i + 7 : i + 9], "big")
            return width, height
        i += 2 + length
    return None


def header_size(data: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) as the file's header declares it, without decoding; None if unknown."""
    if fmt == "jpeg":
        return jpeg_size(data)
    if fmt == "png" and len(data) >= 24 and data[12:16] == b"IHDR":
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    if data[:2] == b"BM" and len(data) >= 26:
        return abs(int.from_bytes(data[18:22], "little", signed=True)), abs(
            int.from_bytes(data[22:26], "little", signed=True)
        )
    if fmt == "webp" and len(data) >= 30:
        chunk = data[12:16]
        if chunk == b"VP8X":
            return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(
                data[27:30], "little"
            )
        if chunk == b"VP8L" and data[20] == 0x2F:
            bits = int.from_bytes(data[21:25], "little")
            return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
        if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
            return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(
                data[28:30], "little"
            ) & 0x3FFF
    return None
