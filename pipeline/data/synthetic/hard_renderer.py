"""The hard look's renderer: the classic one's features on a head layer composited over a cluttered background,
with head roll and yaw and a strong light gradient, to test how often a face detector loses pain frames."""

from __future__ import annotations

import math

import cv2
import numpy as np

from pipeline.data.synthetic.classic_renderer import FaceRenderer
from pipeline.data.synthetic.drawing import Shapes, ellipse_points, shade


class HardFaceRenderer(FaceRenderer):
    """The hard look: a head layer composited over a cluttered background, so the head can roll by +-20 degrees
    without a seam; yaw moves the features (nose and eye sockets included) sideways; a strong light gradient across
    the whole frame is applied last, so it stays in the scene while the head moves."""

    def _draw_layers(self) -> None:
        """The background, the head layer with its alpha, and the frame's light, drawn once per clip."""
        self._feature_colours(1.0)  # unlit: the light is applied to the finished frame
        self.shapes = Shapes(self.subject.face_aspect)
        self.background = self._background_layer()
        self.head, self.alpha = self._head_layer()
        self.light = self._frame_light()
        self.lit_background = np.clip(self.background * self.light, 0, 255).astype(np.uint8)
        rows, columns = np.nonzero(self.alpha > 0.004)
        self.head_corners = np.array([[columns.min(), rows.min()], [columns.max() + 1, rows.min()],
                                      [columns.min(), rows.max() + 1], [columns.max() + 1, rows.max() + 1]], float)

    def _frame_light(self) -> np.ndarray:
        """A gradient across the whole frame (about 0.4x to 1.6x from one side to the other)."""
        s = self.subject
        ys, xs = np.mgrid[0 : self.height, 0 : self.width].astype(np.float32)
        along = (xs - self.width / 2) * math.cos(s.light_angle) + (ys - self.height / 2) * math.sin(s.light_angle)
        gain = 1.0 + s.light_strength * along / (0.5 * math.hypot(self.width, self.height))
        return np.clip(gain, 0.35, 1.7)[..., None]

    def _background_layer(self) -> np.ndarray:
        """The wall (a colour gradient) with clutter (shelves, frames, posters, cables), then the shoulders and neck."""
        s, b = self.subject, self.subject.face_aspect
        ramp = np.linspace(0.0, 1.0, self.height, dtype=np.float32)[:, None, None]
        top, bottom = np.array(s.background[0], np.float32), np.array(s.background[1], np.float32)
        image = np.ascontiguousarray(
            np.broadcast_to(top + ramp * (bottom - top), (self.height, self.width, 3)).astype(np.uint8)
        )
        rng = np.random.default_rng(s.clutter)
        scale = max(self.width, self.height)
        for _ in range(int(rng.integers(8, 20))):
            colour = tuple(float(c) for c in rng.uniform(15, 240, 3))
            x, y = rng.uniform(-0.1, 1.1) * self.width, rng.uniform(-0.1, 1.1) * self.height
            w, h = rng.uniform(0.03, 0.35) * scale, rng.uniform(0.03, 0.35) * scale
            kind = rng.integers(0, 4)
            if kind == 0:  # a filled box: a shelf, a cabinet, a poster
                cv2.rectangle(image, (int(x), int(y)), (int(x + w), int(y + h)), colour, -1, cv2.LINE_AA)
            elif kind == 1:  # a frame
                cv2.rectangle(image, (int(x), int(y)), (int(x + w), int(y + h)), colour,
                              max(1, int(rng.uniform(0.004, 0.015) * scale)), cv2.LINE_AA)
            elif kind == 2:  # a round thing: a clock, a lamp
                cv2.ellipse(image, (int(x), int(y)), (int(w / 3), int(h / 3)), 0, 0, 360, colour, -1, cv2.LINE_AA)
            else:  # a cable, an edge
                cv2.line(image, (int(x), int(y)), (int(x + rng.normal(0, w)), int(y + rng.normal(0, h))), colour,
                         max(1, int(rng.uniform(0.002, 0.01) * scale)), cv2.LINE_AA)
        shapes = self.shapes
        shapes.ellipse(0.0, b + 1.9, 2.5, 1.3, s.shirt)  # shoulders
        shapes.fill(np.array([[-0.45, 0.5], [-0.5, b + 0.95], [0.5, b + 0.95], [0.45, 0.5]]), shade(self.skin, 0.78))
        shapes.ellipse(0.0, b + 0.95, 0.5, 0.12, shade(self.skin, 0.78))  # neckline
        shapes.draw(image, self.base_linear, self.base_offset)
        return cv2.GaussianBlur(image, (0, 0), max(0.5, 0.01 * self.half_width))

    def _head_layer(self) -> tuple[np.ndarray, np.ndarray]:
        """The head (hair, ears, face) at the base pose, and its coverage (alpha, 0..1)."""
        s, shapes, b, skin = self.subject, self.shapes, self.subject.face_aspect, self.skin
        image = np.zeros((self.height, self.width, 3), np.uint8)
        mask = np.zeros((self.height, self.width), np.uint8)
        outline = []
        if s.hair_style == "long":
            outline.append(np.array([[-1.2, -0.4], [-1.35, b + 1.0], [1.35, b + 1.0], [1.2, -0.4]]))
            shapes.fill(outline[-1], s.hair)
        if s.hair_style != "long":
            for side in (-1, 1):
                shapes.ellipse(side * 0.98, 0.05, 0.14, 0.27, shade(skin, 0.9))  # ears
                shapes.ellipse(side * 0.99, 0.05, 0.07, 0.17, shade(skin, 0.75))
                outline.append(ellipse_points(side * 0.98, 0.05, 0.14, 0.27))
        if s.hair_style == "bun":
            shapes.ellipse(0.0, -b - 0.25, 0.4, 0.3, s.hair)
            outline.append(ellipse_points(0.0, -b - 0.25, 0.4, 0.3))
        shapes.ellipse(0.0, -0.12, 1.06, b + 0.12, s.hair)  # hair volume behind the head
        outline.append(ellipse_points(0.0, -0.12, 1.06, b + 0.12))
        shapes.ellipse(0.0, 0.0, 1.0, b, shade(skin, 0.86))  # face, darker towards the rim
        shapes.ellipse(0.0, -0.04, 0.9, b - 0.1, skin)
        outline.append(ellipse_points(0.0, 0.0, 1.0, b))
        shapes.draw(image, self.base_linear, self.base_offset)
        image = cv2.GaussianBlur(image, (0, 0), max(0.6, 0.03 * self.half_width))
        shapes.fill(self._hair_cap(), s.hair)
        outline.append(self._hair_cap())
        shapes.draw(image, self.base_linear, self.base_offset)
        if s.beard > 0:
            beard = image.copy()
            u = np.linspace(-0.96, 0.96, 13)
            top_edge = np.stack([u, 0.1 + 0.5 * (1 - (u / 0.96) ** 2)], axis=1)
            shapes.fill(np.concatenate([top_edge, ellipse_points(0.0, 0.0, 0.97, b, 5, 175)]), s.hair)
            shapes.draw(beard, self.base_linear, self.base_offset)
            image = cv2.addWeighted(beard, s.beard, image, 1 - s.beard, 0)
        for points in outline:
            shapes.fill(points, (255.0, 255.0, 255.0))
        shapes.draw(mask, self.base_linear, self.base_offset)
        alpha = cv2.GaussianBlur(mask.astype(np.float32) / 255.0, (0, 0), max(0.5, 0.015 * self.half_width))
        return cv2.GaussianBlur(image, (0, 0), max(0.5, 0.015 * self.half_width)), alpha

    def _shading(self) -> None:
        """Eye sockets and the nose, drawn with the features so that they follow the yaw."""
        s, shapes, skin = self.subject, self.shapes, self.skin
        for side in (-1, 1):
            shapes.ellipse(side * s.eye_spacing, -0.03, s.eye_width + 0.1, 0.17, shade(skin, 0.8))  # sockets
            shapes.ellipse(side * 0.12, 0.22, 0.06, 0.22, shade(skin, 0.86))  # sides of the nose
            shapes.ellipse(side * 0.12, 0.5, 0.075, 0.06, shade(skin, 0.88))  # nose wings
        shapes.ellipse(0.0, 0.1, 0.06, 0.34, shade(skin, 1.1))  # nose bridge highlight
        shapes.ellipse(0.0, 0.47, 0.11, 0.085, shade(skin, 1.06))  # nose tip

    def render(self, action_units: np.ndarray, pose: np.ndarray, noise_index: int) -> np.ndarray:
        linear, offset = self._pose_transform(pose)
        motion = linear @ self.base_inverse
        warp = np.hstack([motion, (offset - motion @ self.base_offset)[:, None]])
        # Only the head's box changes from frame to frame: composite, draw and light there.
        corners = self.head_corners @ motion.T + warp[:, 2]
        x0, y0 = (max(0, int(v) - 2) for v in corners.min(0))
        x1, y1 = min(self.width, int(corners[:, 0].max()) + 3), min(self.height, int(corners[:, 1].max()) + 3)
        warp[:, 2] -= (x0, y0)
        size = (x1 - x0, y1 - y0)
        head = cv2.warpAffine(self.head, warp, size, flags=cv2.INTER_LINEAR)
        alpha = cv2.warpAffine(self.alpha, warp, size, flags=cv2.INTER_LINEAR)[..., None]
        region = (self.background[y0:y1, x0:x1] * (1.0 - alpha) + head * alpha).astype(np.uint8)
        self.shapes.yaw = float(pose[4])
        self._shading()
        self._features(action_units)
        self.shapes.draw(region, linear, offset - (x0, y0))
        self.shapes.yaw = 0.0
        frame = self.lit_background.copy()
        frame[y0:y1, x0:x1] = np.clip(region * self.light[y0:y1, x0:x1], 0, 255).astype(np.uint8)
        positive, negative = self.noise[noise_index % len(self.noise)]
        return cv2.subtract(cv2.add(frame, positive), negative)
