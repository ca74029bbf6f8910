"""Image files for the serving tests, built byte by byte: a PNG bomb."""

from __future__ import annotations

import struct
import zlib

from pipeline.runs.serving.serving_input import PNG_SIGNATURE


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int, height: int, rows: int | None = None) -> bytes:
    """An 8-bit grey PNG of `width` x `height` black pixels built with zlib: `rows` of image data (all of them by
    default: a 30000 x 30000 one is 0.9 MB and decodes to 2.7 GB as BGR). The compressed block of 500 rows, flushed
    so that it stands alone, is repeated; the checksum is the whole image's."""
    rows = height if rows is None else rows
    block_rows = min(500, max(rows, 1))
    block = bytes((width + 1) * block_rows)  # each row: filter byte 0, then the pixels
    blocks, rest = divmod(rows, block_rows)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    once = packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH)
    tail = packer.compress(bytes((width + 1) * rest)) + packer.flush(zlib.Z_FINISH)
    checksum = 1
    for _ in range(blocks):
        checksum = zlib.adler32(block, checksum)
    checksum = zlib.adler32(bytes((width + 1) * rest), checksum)
    stream = b"\x78\xda" + once * blocks + tail + struct.pack(">I", checksum)
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return PNG_SIGNATURE + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", stream) + png_chunk(b"IEND", b"")
