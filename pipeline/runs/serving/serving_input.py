"""What one scoring request may send, and how its frames are read without exhausting the server.

`ServingLimits` bounds a request: frames, body size, seconds, pixels a frame (a side and in all) and pixels a request,
and the folder `path` inputs may read. They are the `serve` settings of configs/config.yaml, read once: `make serve`
hands them to the model through the environment (`to_env`), and a model loaded anywhere else (`mlflow models serve`,
a notebook) reads the variables it finds and the configured settings for the rest (`from_env`).

A frame is read in this order, each step before anything costlier:

1. its bytes: the request's `image` (base64), or a `path` file opened without following a link in its last component
   (`O_NOFOLLOW`; `O_NONBLOCK`, so a FIFO cannot hold the request), a regular file (`os.fstat` of the opened
   descriptor) that lies beneath `path_root` (the opened descriptor's own path, resolved) and is no larger than the
   request body may be;
2. its kind, from its first bytes (magic numbers): PNG or JPEG; a TIFF, WebP, PNM, JPEG 2000, HDR, ... is refused,
   though OpenCV would decode it;
3. its width and height, from its header (PNG: IHDR; JPEG: the first SOFn marker), against the caps a frame and a
   request: an image bomb (a 0.9 MB PNG whose header says 30000 x 30000, 2.7 GB decoded) costs a few bytes read;
4. only then decoding, by OpenCV, whose own cap (`OPENCV_IO_MAX_IMAGE_PIXELS`, read once, when cv2 loads) is set to
   the frame cap wherever the project starts a scoring process before cv2 loads (`cap_opencv_pixels`: `make serve`,
   and the model's code file under `mlflow models serve`); `opencv_caps_at` checks that it took effect.

A refusal is a `FrameRefused` whose message names what was wrong in a line, never a path of the server's.
This module does not import cv2 at its top, so that importing it leaves OpenCV's cap still to be set.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import struct
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pipeline.utils.config import CONFIG_DIR

OPENCV_PIXELS_ENV = "OPENCV_IO_MAX_IMAGE_PIXELS"  # OpenCV's own: the most pixels its decoders take (default 2^30)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SIGNATURE = b"\xff\xd8\xff"
# SOFn: the markers of a JPEG frame header (height, width); C4 (DHT), C8 (JPG) and CC (DAC) share the range only
JPEG_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
JPEG_STANDALONE_MARKERS = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: no length field
MAX_MESSAGE = 300  # characters of an error message sent back
SHOWN_VALUE = 60  # characters of a client's value quoted in a refusal


class FrameRefused(ValueError):
    """A frame the server does not read; the message (one line) says why."""


@dataclass(frozen=True)
class ServingLimits:
    """What one scoring request may ask, and how many are served at once (the `serve` settings; see the module
    docstring)."""

    path_root: Path | None  # the folder `path` inputs may read (resolved); None: `path` inputs are refused
    max_frames: int  # frames (rows) per request
    max_body_mb: float  # request body, enforced by the HTTP server in front (pipeline.deployment.serving); a path file
    timeout_s: float  # seconds one request may take, decoding included
    max_frame_side: int  # pixels a frame may have on either side
    max_frame_pixels: int  # pixels a frame may have (also OpenCV's own cap)
    max_request_pixels: int  # pixels the frames of one request may have together
    scorers: int  # requests decoded and scored at once, each by a scorer of its own (pipeline.runs.serving.scorer_pool)
    max_in_flight: int  # requests the HTTP server in front takes at once (read, waiting or scored); 503 beyond

    ENV = {"path_root": "PAIN_SERVE_PATH_ROOT", "max_frames": "PAIN_SERVE_MAX_FRAMES",
           "max_body_mb": "PAIN_SERVE_MAX_BODY_MB", "timeout_s": "PAIN_SERVE_TIMEOUT_S",
           "max_frame_side": "PAIN_SERVE_MAX_FRAME_SIDE", "max_frame_pixels": "PAIN_SERVE_MAX_FRAME_PIXELS",
           "max_request_pixels": "PAIN_SERVE_MAX_REQUEST_PIXELS", "scorers": "PAIN_SERVE_SCORERS",
           "max_in_flight": "PAIN_SERVE_MAX_IN_FLIGHT"}
    WHOLE = ("max_frames", "max_frame_side", "max_frame_pixels", "max_request_pixels", "scorers",
             "max_in_flight")  # counts, not measures

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], names: Mapping[str, str] | None = None) -> ServingLimits:
        """The limits of `serve` settings (numbers or their text); `names` says what to call a key in an error
        (default `serve.<key>`). `path_root` `/` is refused: it would let a request read every file of the machine."""
        values: dict[str, Any] = {}
        for key in cls.ENV:
            name, raw = (names or {}).get(key, f"serve.{key}"), settings.get(key)
            text = "" if raw is None else str(raw).strip()
            if key == "path_root":
                values[key] = path_root_of(text, name) if text else None
                continue
            if not text:
                raise ValueError(f"{name} is not set")
            try:
                number = int(text) if key in cls.WHOLE else float(text)
            except ValueError:
                raise ValueError(f"{name}={text}: not a{' whole' if key in cls.WHOLE else ''} number") from None
            if not number > 0 or not math.isfinite(number):
                raise ValueError(f"{name}={text}: must be above 0")
            values[key] = number
        return cls(**values)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServingLimits:
        """The limits the variables of `env` (default: this process's) give, the configured `serve` settings where
        a variable is unset or empty."""
        env = os.environ if env is None else env
        given = {key: env[name] for key, name in cls.ENV.items() if env.get(name, "").strip()}
        return cls.from_settings({**configured_serve_settings(), **given},
                                 names={key: cls.ENV[key] for key in given})

    def to_env(self) -> dict[str, str]:
        """The variables that give a scoring process these limits."""
        return {name: "" if getattr(self, key) is None else str(getattr(self, key)) for key, name in self.ENV.items()}

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def check_frame(self, width: int, height: int) -> None:
        """A frame of `width` x `height` pixels, refused above the caps a frame has."""
        if max(width, height) > self.max_frame_side:
            raise FrameRefused(f"a frame of {width} x {height} pixels; the limit is {self.max_frame_side} on either "
                               f"side ({self.ENV['max_frame_side']})")
        if width * height > self.max_frame_pixels:
            raise FrameRefused(f"a frame of {width} x {height} = {width * height} pixels; the limit is "
                               f"{self.max_frame_pixels} ({self.ENV['max_frame_pixels']})")


@cache
def configured_serve_settings() -> dict[str, Any]:
    """The `serve` block of configs/config.yaml, as written there (read once)."""
    return dict(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml").serve))


def path_root_of(text: str, name: str) -> Path:
    """The folder `path` inputs may read, resolved (a relative one from the current folder); `/` and a missing
    folder are errors."""
    root = Path(text).expanduser().resolve()
    if not root.is_dir():
        raise ValueError(f"{name}={text}: no such folder")
    if root.parent == root:
        raise ValueError(f"{name}={text}: the root of the file system would let a request read every file of this "
                         f"machine; name the folder the frames are in")
    return root


def one_line(message: str) -> str:
    """The part of an error message a client needs: MLflow's "Failed to predict data '<the request>'. Error: ..."
    loses the echo of the request, then the first line, at most `MAX_MESSAGE` characters."""
    if "\nError: " in message:
        message = message.rsplit("\nError: ", 1)[1]
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = lines[0] if lines else "error"
    return first if len(first) <= MAX_MESSAGE else first[: MAX_MESSAGE - 3] + "..."


def shown(value: str) -> str:
    """A client's value quoted in a refusal: its repr, at most `SHOWN_VALUE` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE else text[: SHOWN_VALUE - 4] + "...'"


def other_kind(data: bytes) -> str | None:
    """The name of an image format OpenCV decodes but the server does not take, told by its first bytes."""
    signatures = ((b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
                  (b"\xffO\xffQ", "JPEG 2000"), (b"#?RADIANCE", "HDR"), (b"#?RGBE", "HDR"), (b"GIF8", "GIF"),
                  (b"BM", "BMP"), (b"v/1\x01", "OpenEXR"), (b"\x00\x00\x00\x0cJXL ", "JPEG XL"), (b"\xff\n", "JPEG XL"))
    for signature, name in signatures:
        if data.startswith(signature):
            return name
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WebP"
    if len(data) > 2 and data[:1] == b"P" and data[1:2] in b"1234567fF" and data[2:3].isspace():
        return "PNM"  # PBM, PGM, PPM, PAM, PFM
    return None


def frame_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG or JPEG, from its header alone; anything else is refused."""
    if data.startswith(PNG_SIGNATURE):
        return png_size(data)
    if data.startswith(JPEG_SIGNATURE):
        return jpeg_size(data)
    kind = other_kind(data)
    raise FrameRefused(f"the image is {kind}; this server takes PNG or JPEG only" if kind else
                       "not a PNG or JPEG image (its first bytes are neither's signature)")


def png_size(data: bytes) -> tuple[int, int]:
    """A PNG's size from its IHDR chunk, which must come first."""
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise FrameRefused("a PNG without its IHDR header first")
    width, height = struct.unpack(">II", data[16:24])
    if not width or not height:
        raise FrameRefused(f"a PNG whose header says {width} x {height} pixels")
    return width, height


def jpeg_size(data: bytes) -> tuple[int, int]:
    """A JPEG's size from its first frame header (SOFn), the one the decoder uses; the markers before it are walked
    by their lengths. A JPEG whose image data (SOS) or end comes first is refused, as is a height of 0 (one a DNL
    marker would give later)."""
    at, end = 2, len(data)
    while at < end:
        if data[at] != 0xFF:
            raise FrameRefused("a JPEG whose markers are damaged")
        while at < end and data[at] == 0xFF:  # fill bytes
            at += 1
        if at >= end:
            break
        marker = data[at]
        at += 1
        if marker in JPEG_STANDALONE_MARKERS:
            continue
        if marker in (0xD9, 0xDA):  # EOI, SOS
            break
        if at + 2 > end:
            break
        length = int.from_bytes(data[at:at + 2], "big")
        if length < 2:
            raise FrameRefused("a JPEG whose markers are damaged")
        if marker in JPEG_FRAME_MARKERS:
            if at + 7 > end:
                break
            height, width = struct.unpack(">HH", data[at + 3:at + 7])
            if not width or not height:
                raise FrameRefused(f"a JPEG whose frame header says {width} x {height} pixels")
            return width, height
        at += length
    raise FrameRefused("a JPEG without a frame header (SOFn) before its image data")


def decode_frame(data: bytes, width: int, height: int):
    """The BGR frame of PNG/JPEG bytes whose header said `width` x `height` (already checked against the caps)."""
    import cv2
    import numpy as np

    frame = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if frame is None:
        raise FrameRefused("the image could not be decoded (damaged or truncated)")
    if frame.shape[0] * frame.shape[1] != width * height:
        raise FrameRefused(f"the image decoded to {frame.shape[1]} x {frame.shape[0]} pixels, not the {width} x "
                           f"{height} its header says")
    return frame


def is_beneath(path: str | Path, root: Path) -> bool:
    return Path(path).is_relative_to(root)


def read_beneath(value: str, root: Path | None, max_bytes: int) -> bytes:
    """The bytes of the regular file `value` names under `root` (a relative name from `root`), opened without
    following a link in its last component, and checked beneath `root` as opened. The refusal of a name outside
    `root` reads the same whether it exists, and names no path of the server's."""
    if root is None:
        raise FrameRefused(f"'path' inputs are off on this server (send the frame as 'image'; "
                           f"{ServingLimits.ENV['path_root']}=<folder> allows one folder)")
    outside = FrameRefused(f"path {shown(value)} is outside the folder this server reads from")
    if "\x00" in value:
        raise FrameRefused(f"path {shown(value)} holds a NUL character")
    joined = os.path.normpath(os.path.join(root, value))  # `..` collapsed by name, before the file system is asked
    if not is_beneath(joined, root):
        raise outside
    try:
        descriptor = os.open(joined, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise FrameRefused(open_error(value, error)) from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise FrameRefused(f"path {shown(value)} is not a regular file (a folder, FIFO, socket or device)")
        if not is_beneath(opened_path(descriptor, joined), root):  # a link among the folders above it led outside
            raise outside
        if info.st_size > max_bytes:
            raise FrameRefused(f"path {shown(value)} is a file of {info.st_size} bytes; the limit is {max_bytes} "
                               f"({ServingLimits.ENV['max_body_mb']})")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(descriptor, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:  # it grew while being read
            raise FrameRefused(f"path {shown(value)} is a file over the limit of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(descriptor)


def opened_path(descriptor: int, joined: str) -> Path:
    """Where the file open on `descriptor` is, links resolved: the kernel's own answer (/proc/self/fd), or where
    the name leads now on a system without /proc."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{descriptor}"))
    except OSError:
        return Path(os.path.realpath(joined))


def open_error(value: str, error: OSError) -> str:
    """The refusal of a `path` that could not be opened: the client's own value and the reason, never the path."""
    if error.errno == errno.ELOOP:
        return f"path {shown(value)} is a symbolic link (or a loop of them); this server reads regular files only"
    if error.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"no readable image file {shown(value)} in the folder this server reads from"
    return f"path {shown(value)} cannot be opened ({os.strerror(error.errno) if error.errno else type(error).__name__})"


def cap_opencv_pixels(max_pixels: int) -> None:
    """OpenCV's own cap on the pixels it decodes set to `max_pixels`, if cv2 is not loaded yet: OpenCV reads the
    variable once, when it loads, so a later change does nothing (`opencv_caps_at` tells)."""
    if "cv2" not in sys.modules:
        os.environ[OPENCV_PIXELS_ENV] = str(int(max_pixels))


def opencv_caps_at(max_pixels: int) -> bool:
    """Whether OpenCV, as loaded in this process, refuses from its header alone a PNG of more than `max_pixels`
    pixels (one whose image data chunk is empty: nothing is decoded either way; without that chunk OpenCV reads no
    header at all)."""
    import cv2
    import numpy as np

    side = math.isqrt(max_pixels) + 1  # side * side > max_pixels
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    png = PNG_SIGNATURE + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", b"") + png_chunk(b"IEND", b"")
    try:
        cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_GRAYSCALE)
    except cv2.error as error:
        return "CV_IO_MAX_IMAGE_PIXELS" in str(error)
    return False


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
