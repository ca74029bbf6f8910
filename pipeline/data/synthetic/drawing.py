"""Drawing primitives in face-local coordinates (unit = face half-width): colours, curves, bands, the batched
`Shapes` queue, head yaw and the face-local -> pixel map, shared by both renderers and by the region boxes."""

from __future__ import annotations

import math

import cv2
import numpy as np

from pipeline.data.synthetic.roster import Subject

_SHIFT = 4  # sub-pixel drawing: OpenCV takes coordinates as fixed point with this many fractional bits
_ONE = 1 << _SHIFT

Colour = tuple[float, float, float]


def blend(colour_a: Colour, colour_b: Colour, weight: float) -> Colour:
    """Colour `weight` of the way from a to b (a flat-colour stand-in for alpha blending)."""
    weight = min(1.0, max(0.0, weight))
    return tuple(a + (b - a) * weight for a, b in zip(colour_a, colour_b, strict=True))


def shade(colour: Colour, factor: float) -> Colour:
    return tuple(min(255.0, c * factor) for c in colour)


UNIT = np.linspace(0.0, 1.0, 9)
_UNIT_BUMP = np.sin(math.pi * UNIT)
SYMMETRIC = np.linspace(-1.0, 1.0, 13)
_CIRCLE = np.stack([np.cos(np.linspace(0, 2 * math.pi, 25)[:-1]), np.sin(np.linspace(0, 2 * math.pi, 25)[:-1])], 1)


def arc(u0: float, u1: float, v: float, bulge: float) -> np.ndarray:
    """Points of a curve from (u0, v) to (u1, v) bent by `bulge` (negative = up) at the middle."""
    return curve(u0 + (u1 - u0) * UNIT, v + bulge * _UNIT_BUMP)


def ellipse_points(
    cu: float, cv: float, au: float, av: float, start_deg: float = 0.0, end_deg: float | None = None, n: int = 17
) -> np.ndarray:
    if end_deg is None:
        return _CIRCLE * (au, av) + (cu, cv)
    angles = np.radians(np.linspace(start_deg, end_deg, n))
    return np.stack([cu + au * np.cos(angles), cv + av * np.sin(angles)], axis=1)


def curve(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    points = np.empty((len(u), 2))
    points[:, 0], points[:, 1] = u, v
    return points


def band(u: np.ndarray, top: np.ndarray, bottom: np.ndarray) -> np.ndarray:
    """Closed outline of the region between two curves sampled at the same u."""
    n = len(u)
    points = np.empty((2 * n, 2))
    points[:n, 0], points[:n, 1] = u, top
    points[n:, 0], points[n:, 1] = u[::-1], bottom[::-1]
    return points


class Shapes:
    """Shapes in face-local coordinates, transformed together and drawn in one pass (drawing is per frame, and
    one matrix product for all points is much cheaper than one per shape)."""

    def __init__(self, aspect: float = 1.3) -> None:
        self.items: list[tuple[np.ndarray, Colour, float, bool]] = []
        self.yaw = 0.0  # radians; turns the features about the head's vertical axis (`yawed`)
        self.aspect = aspect

    def fill(self, points: np.ndarray, colour: Colour) -> None:
        self.items.append((points, colour, 0.0, True))

    def line(self, points: np.ndarray, colour: Colour, width: float, closed: bool = False) -> None:
        self.items.append((points, colour, width, closed))

    def ellipse(self, cu: float, cv: float, au: float, av: float, colour: Colour, width: float = 0.0) -> None:
        points = ellipse_points(cu, cv, au, av)
        if width:
            self.line(points, colour, width, closed=True)
        else:
            self.fill(points, colour)

    def draw(self, image: np.ndarray, linear: np.ndarray, offset: np.ndarray) -> None:
        """Draw everything with local -> pixel map `p = linear @ q + offset`, anti-aliased, sub-pixel."""
        if not self.items:
            return
        pixels_per_unit = math.sqrt(abs(np.linalg.det(linear)))
        points = np.concatenate([item[0] for item in self.items])
        if self.yaw:
            points = yawed(points, self.yaw, self.aspect)
        pixels = np.rint((points @ linear.T + offset) * _ONE).astype(np.int32)
        start = 0
        for shape_points, colour, width, closed in self.items:
            part, start = pixels[start : start + len(shape_points)], start + len(shape_points)
            if width == 0.0:
                cv2.fillPoly(image, [part], colour, cv2.LINE_AA, _SHIFT)
            else:
                cv2.polylines(
                    image, [part], closed, colour, max(1, round(width * pixels_per_unit)), cv2.LINE_AA, _SHIFT
                )
        self.items.clear()


def yawed(points: np.ndarray, yaw: float, aspect: float) -> np.ndarray:
    """Face-local points as seen with the head turned by `yaw` about its vertical axis: each point's depth on a head
    ellipsoid (the nose standing out) moves it sideways, and the face narrows by cos(yaw)."""
    out = points.copy()
    out[:, 0] = points[:, 0] * math.cos(yaw) + head_depth(points, aspect) * math.sin(yaw)
    return out


def yawed_frames(points: np.ndarray, yaws: np.ndarray, aspect: float) -> np.ndarray:
    """`yawed(points, yaw)` for each of `yaws` at once (yaws x points x 2), the points as they are where a yaw is 0:
    the same arithmetic, value for value."""
    frames = np.repeat(points[None], len(yaws), axis=0)
    turned = np.flatnonzero(yaws)
    cos = np.array([math.cos(yaws[index]) for index in turned])[:, None]
    sin = np.array([math.sin(yaws[index]) for index in turned])[:, None]
    frames[turned, :, 0] = points[:, 0] * cos + head_depth(points, aspect) * sin
    return frames


def head_depth(points: np.ndarray, aspect: float) -> np.ndarray:
    """How far each face-local point stands out of the face plane: on a head ellipsoid, the nose more."""
    u, v = points[:, 0], points[:, 1]
    depth = 0.75 * np.sqrt(np.clip(1.0 - u**2 - (v / aspect) ** 2, 0.0, None))
    depth += 0.3 * np.exp(-((u / 0.14) ** 2) - ((v - 0.35) / 0.25) ** 2)  # the nose
    return depth


def face_transform(subject: Subject, width: int, height: int, pose: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Face-local -> pixel map (linear part, offset) of a canvas for a pose (dx, dy in half-widths, roll, scale[,
    yaw]: yaw acts on face-local points, `yawed`)."""
    half_width = subject.face_scale * height
    dx, dy, roll, scale = (float(v) for v in pose[:4])
    rotation = scale * np.array([[math.cos(roll), -math.sin(roll)], [math.sin(roll), math.cos(roll)]])
    return half_width * rotation, np.array([subject.head_x * width, subject.head_y * height]) + half_width * np.array(
        [dx, dy])
