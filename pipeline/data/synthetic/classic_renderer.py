"""The classic look's renderer: a static head layer drawn once per clip and warped by the head pose, with the
moving pain features (brows, eyes, wrinkles, mouth, glasses) drawn on top each frame."""

from __future__ import annotations

import math

import cv2
import numpy as np

from pipeline.data.synthetic.drawing import (
    SYMMETRIC,
    UNIT,
    Shapes,
    arc,
    band,
    blend,
    curve,
    ellipse_points,
    face_transform,
    shade,
)
from pipeline.data.synthetic.roster import Subject


class FaceRenderer:
    """Draws one subject's frames: a static head layer (background, hair, face shading, lighting) moved by the head
    pose, then the moving features (brows, eyes, wrinkles, mouth, glasses) on top.

    Face-local coordinates: origin at the face centre, unit = face half-width, v pointing down. Only the head's
    region is warped each frame (warping the whole frame costs more than everything else together).
    """

    def __init__(
        self,
        subject: Subject,
        width: int,
        height: int,
        base_pose: np.ndarray,
        noise_sigma: float,
        rng: np.random.Generator,
    ):
        self._place(subject, width, height, base_pose)
        self._draw_layers()
        self.noise = self._noise_pool(noise_sigma, rng)

    def _draw_layers(self) -> None:
        """What every frame starts from, drawn once per clip.

        The static layer is drawn at the clip's first pose; frames only warp it by the (small) motion since then,
        which keeps the seam where the warped head region meets the still background below a pixel or two.
        """
        light = self._light_gain()
        gain = float(light[int(self.centre[1]), int(self.centre[0])])
        self._feature_colours(gain)  # features are drawn over lit skin
        self.shapes = Shapes()
        self.static = self._static_layer(light)
        b = self.subject.face_aspect
        x0, y0 = self.base_offset + self.half_width * np.array([-1.45, -b - 0.6])
        x1, y1 = self.base_offset + self.half_width * np.array([1.45, b + 1.0])
        self.head_box = (
            max(0, int(x0)),
            max(0, int(y0)),
            min(self.width, int(math.ceil(x1))),
            min(self.height, int(math.ceil(y1))),
        )

    def _place(self, subject: Subject, width: int, height: int, base_pose: np.ndarray) -> None:
        """The frame size, the face's size and centre, and the face-local -> pixel map at `base_pose`."""
        self.subject, self.width, self.height = subject, width, height
        self.half_width = subject.face_scale * height
        self.centre = np.array([subject.head_x * width, subject.head_y * height])
        self.base_linear, self.base_offset = self._pose_transform(base_pose)
        self.base_inverse = np.linalg.inv(self.base_linear)

    def _feature_colours(self, gain: float) -> None:
        """The colours of skin, shadows, brows, lips and glasses, with the light's `gain` at the face centre."""
        subject = self.subject
        self.skin = shade(subject.skin, gain)
        self.dark = shade(self.skin, 0.45)
        self.brow = shade(subject.hair, 0.55 * gain) if sum(subject.hair) < 420 else shade(self.skin, 0.42)
        self.lips = blend(self.skin, (70, 70, 165), 0.35)
        self.glasses = (30.0, 30.0, 35.0) if subject.light_angle < math.pi else (60.0, 75.0, 95.0)

    def _pose_transform(self, pose: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Face-local -> pixel map (linear part, offset) for a pose (dx, dy in half-widths, roll, scale)."""
        return face_transform(self.subject, self.width, self.height, pose)

    def _base_transform(self) -> tuple[np.ndarray, np.ndarray]:
        return self.base_linear, self.base_offset

    # -- the parts that do not move relative to the head
    def _light_gain(self) -> np.ndarray:
        """Multiplicative light from one side, baked into the static layer (head motion is too small to show it)."""
        s = self.subject
        ys, xs = np.mgrid[0 : self.height, 0 : self.width].astype(np.float32)
        along = (xs - self.centre[0]) * math.cos(s.light_angle) + (ys - self.centre[1]) * math.sin(s.light_angle)
        return np.clip(0.97 + s.light_strength * along / (1.5 * self.half_width), 0.55, 1.35)

    def _static_layer(self, light: np.ndarray) -> np.ndarray:
        s, shapes, b = self.subject, self.shapes, self.subject.face_aspect
        skin = s.skin
        ramp = np.linspace(0.0, 1.0, self.height, dtype=np.float32)[:, None, None]
        top, bottom = np.array(s.background[0], np.float32), np.array(s.background[1], np.float32)
        image = np.ascontiguousarray(
            np.broadcast_to(top + ramp * (bottom - top), (self.height, self.width, 3)).astype(np.uint8)
        )
        shapes.ellipse(0.0, b + 1.9, 2.5, 1.3, s.shirt)  # shoulders
        if s.hair_style == "long":
            shapes.fill(np.array([[-1.2, -0.4], [-1.35, b + 1.0], [1.35, b + 1.0], [1.2, -0.4]]), s.hair)
        shapes.fill(np.array([[-0.45, 0.5], [-0.5, b + 0.95], [0.5, b + 0.95], [0.45, 0.5]]), shade(skin, 0.78))
        shapes.ellipse(0.0, b + 0.95, 0.5, 0.12, shade(skin, 0.78))  # neckline
        if s.hair_style != "long":
            for side in (-1, 1):
                shapes.ellipse(side * 0.98, 0.05, 0.14, 0.27, shade(skin, 0.9))  # ears
                shapes.ellipse(side * 0.99, 0.05, 0.07, 0.17, shade(skin, 0.75))
        if s.hair_style == "bun":
            shapes.ellipse(0.0, -b - 0.25, 0.4, 0.3, s.hair)
        shapes.ellipse(0.0, -0.12, 1.06, b + 0.12, s.hair)  # hair volume behind the head
        shapes.ellipse(0.0, 0.0, 1.0, b, shade(skin, 0.86))  # face, darker towards the rim
        shapes.ellipse(0.0, -0.04, 0.9, b - 0.1, skin)
        for side in (-1, 1):
            shapes.ellipse(side * 0.5, 0.42, 0.2, 0.14, blend(skin, (90, 90, 200), 0.12))  # cheeks
            shapes.ellipse(side * s.eye_spacing, -0.03, s.eye_width + 0.1, 0.17, shade(skin, 0.76))  # sockets
            shapes.ellipse(side * 0.12, 0.22, 0.06, 0.22, shade(skin, 0.86))  # sides of the nose
            shapes.ellipse(side * 0.12, 0.5, 0.075, 0.06, shade(skin, 0.88))  # nose wings
        shapes.ellipse(0.0, 0.1, 0.06, 0.34, shade(skin, 1.1))  # nose bridge highlight
        shapes.ellipse(0.0, 0.47, 0.11, 0.085, shade(skin, 1.06))  # nose tip
        shapes.ellipse(0.0, 0.99, 0.22, 0.07, shade(skin, 0.9))  # under the lower lip
        shapes.draw(image, *self._base_transform())
        image = cv2.GaussianBlur(image, (0, 0), max(0.6, 0.03 * self.half_width))
        shapes.fill(self._hair_cap(), s.hair)
        shapes.draw(image, *self._base_transform())
        if s.beard > 0:
            beard = image.copy()
            u = np.linspace(-0.96, 0.96, 13)
            top_edge = np.stack([u, 0.1 + 0.5 * (1 - (u / 0.96) ** 2)], axis=1)  # sideburns to under the nose
            shapes.fill(np.concatenate([top_edge, ellipse_points(0.0, 0.0, 0.97, b, 5, 175)]), s.hair)
            shapes.draw(beard, *self._base_transform())
            image = cv2.addWeighted(beard, s.beard, image, 1 - s.beard, 0)
        image = cv2.GaussianBlur(image, (0, 0), max(0.5, 0.015 * self.half_width))
        lit = image.astype(np.float32) * light[..., None]
        return np.clip(lit, 0, 255).astype(np.uint8)

    def _hair_cap(self) -> np.ndarray:
        s, b = self.subject, self.subject.face_aspect
        outline = ellipse_points(0.0, -0.08, 1.04, b + 0.1, 190, 350, 25)  # over the top of the head
        u = np.linspace(0.98, -0.98, 21)
        receding = s.hair_style == "receding"
        temple = -0.45 if receding else -0.25
        hairline = -s.hairline + (temple + s.hairline) * np.abs(u) ** (0.7 if receding else 1.6)
        if s.hair_style == "fringe":  # swept to one side, but above the brows
            hairline = np.minimum(hairline + 0.2 * (1 - (u + 1) / 2), -0.62)
        return np.concatenate([outline, np.stack([u, hairline], axis=1)])

    def _noise_pool(self, sigma: float, rng: np.random.Generator, size: int = 3) -> list[tuple[np.ndarray, ...]]:
        """A few grey noise images (as positive and negative parts, so uint8 saturating adds apply them)."""
        pool = []
        for _ in range(size):
            noise = np.repeat(rng.normal(0.0, sigma, (self.height, self.width, 1)).astype(np.float32), 3, axis=2)
            pool.append((np.clip(noise, 0, 255).astype(np.uint8), np.clip(-noise, 0, 255).astype(np.uint8)))
        return pool

    # -- the parts that move
    def render(self, action_units: np.ndarray, pose: np.ndarray, noise_index: int) -> np.ndarray:
        """One frame for the given action units (AU4, AU6/7, AU9/10, closure) and pose (dx, dy, roll, scale)."""
        linear, offset = self._pose_transform(pose)
        # Move the head region of the static layer by the motion since the base pose: p -> M (p - c0) + c1.
        motion = linear @ self.base_inverse
        x0, y0, x1, y1 = self.head_box
        corner = np.array([x0, y0], dtype=float)
        shift = motion @ (corner - self.base_offset) + offset - corner
        frame = self.static.copy()
        frame[y0:y1, x0:x1] = cv2.warpAffine(
            self.static[y0:y1, x0:x1],
            np.hstack([motion, shift[:, None]]),
            (x1 - x0, y1 - y0),
            flags=cv2.INTER_LINEAR,
            borderMode=cv2.BORDER_REPLICATE,
        )
        self._features(action_units)
        self.shapes.draw(frame, linear, offset)
        positive, negative = self.noise[noise_index % len(self.noise)]
        return cv2.subtract(cv2.add(frame, positive), negative)

    def _features(self, action_units: np.ndarray) -> None:
        """Queue the moving features for a frame's action units (AU4, AU6/7, AU9/10, eye closure)."""
        au4, au67, au910, closure = (float(v) for v in action_units)
        self._brows(au4)
        for side in (-1, 1):
            self._eye(side, au67, closure)
        self._wrinkles(au4, au67, au910)
        self._mouth(au910)
        if self.subject.glasses:
            self._glasses()

    def _brows(self, au4: float) -> None:
        s = self.subject
        inner = np.array([0.13 - 0.05 * au4, -0.3 + 0.13 * au4])
        outer = np.array([0.66, -0.33 + 0.04 * au4])
        centre = inner + UNIT[:, None] * (outer - inner)
        centre[:, 1] -= (0.07 - 0.05 * au4) * np.sin(math.pi * np.minimum(1.0, UNIT * 1.3))
        half = s.brow_thickness * (1.15 - 0.55 * UNIT) / 2
        outline = band(centre[:, 0], centre[:, 1] - half, centre[:, 1] + half)
        for side in (-1, 1):
            self.shapes.fill(outline * (side, 1), self.brow)

    def _eye(self, side: int, au67: float, closure: float) -> None:
        s = self.subject
        u0, v0 = side * s.eye_spacing, -0.02 + 0.015 * closure - 0.01 * au67
        width = s.eye_width * (1 - 0.06 * au67)
        opening = 1.0 - closure
        upper_height = 0.095 * (1 - 0.3 * au67) * opening
        lower_height = 0.055 * (1 - 0.7 * au67) * opening
        u = u0 + width * SYMMETRIC
        shape = 1 - SYMMETRIC**2
        upper = v0 - upper_height * shape**0.8
        lower = v0 + lower_height * shape
        if opening > 0.08:
            self.shapes.fill(band(u, upper, lower), (225.0, 230.0, 235.0))
            iris_u, iris_v = u0 + 0.02 * side, v0 - 0.01
            for radius, colour in ((0.08, s.iris), (0.036, (15.0, 15.0, 15.0))):
                # The iris disc clipped to the open eye: between the lids, column by column.
                ui = iris_u + radius * SYMMETRIC
                half = radius * np.sqrt(shape)
                xn = np.clip((ui - u0) / width, -1.0, 1.0)
                top = np.maximum(iris_v - half, v0 - upper_height * (1 - xn**2) ** 0.8)
                bottom = np.maximum(top, np.minimum(iris_v + half, v0 + lower_height * (1 - xn**2)))
                self.shapes.fill(band(ui, top, bottom), colour)
        self.shapes.line(curve(u, upper), self.dark, 0.035)  # lash line: stays dark when the eye closes
        self.shapes.line(curve(u, lower), shade(self.skin, 0.65), 0.015)
        crease = arc(u0 - width * 0.9, u0 + width * 0.9, v0 - 0.12 + 0.03 * au67 + 0.02 * closure, -0.04)
        self.shapes.line(crease, shade(self.skin, 0.6), 0.02)

    def _wrinkles(self, au4: float, au67: float, au910: float) -> None:
        s, shapes = self.subject, self.shapes
        if au4 > 0.1:  # vertical furrows between the lowered brows
            for side in (-1, 1):
                shapes.line(
                    np.array([[side * 0.05, -0.32], [side * 0.06, -0.15]]), blend(self.skin, self.dark, 0.7 * au4), 0.02
                )
        if au67 > 0.1:  # raised cheeks: a furrow under the lower lid
            for side in (-1, 1):
                u0 = side * s.eye_spacing
                shapes.line(
                    arc(u0 - 0.17, u0 + 0.17, 0.12 - 0.02 * au67, 0.05), blend(self.skin, self.dark, 0.6 * au67), 0.02
                )
        if au910 > 0.1:  # nose wrinkle
            for v in (-0.06, 0.0, 0.06):
                shapes.line(arc(-0.08, 0.08, v, -0.02), blend(self.skin, self.dark, 0.6 * au910), 0.015)
        for side in (-1, 1):  # nasolabial folds, deepened by the raised upper lip
            fold = np.array([[0.17 * side, 0.47], [0.26 * side, 0.62], [0.33 * side, 0.78], [0.36 * side, 0.92]])
            fold[:, 1] -= 0.04 * au910
            shapes.line(fold, blend(self.skin, self.dark, 0.2 + 0.5 * au910), 0.02)
            shapes.ellipse(
                side * 0.07, 0.53 - 0.03 * au910, 0.035 * (1 + 0.4 * au910), 0.018, (35.0, 35.0, 45.0)
            )  # nostril

    def _mouth(self, au910: float) -> None:
        s, shapes = self.subject, self.shapes
        centre, x = 0.82, SYMMETRIC
        shape = 1 - x**2
        u = s.mouth_width * (1 + 0.1 * au910) * x
        lift = 0.07 * au910  # upper-lip raise opens the mouth
        upper_bottom = centre - lift * shape
        upper_top = upper_bottom - 0.045 * np.sqrt(shape) - 0.008 * shape - 0.012 * np.cos(2 * math.pi * x) * shape
        lower_top = centre + 0.01 * au910 * shape
        lower_bottom = lower_top + 0.065 * np.sqrt(shape)
        if lift > 0.004:
            shapes.fill(band(u, upper_bottom, lower_top), (40.0, 30.0, 55.0))
            shapes.fill(band(u * 0.8, upper_bottom, upper_bottom + 0.6 * lift * shape), (215.0, 220.0, 225.0))
        shapes.fill(band(u, upper_top, upper_bottom), shade(self.lips, 0.92))
        shapes.fill(band(u, lower_top, lower_bottom), self.lips)
        shapes.line(curve(u, upper_bottom), shade(self.lips, 0.55), 0.015)

    def _glasses(self) -> None:
        s, shapes = self.subject, self.shapes
        rim = s.eye_width + 0.09
        for side in (-1, 1):
            shapes.ellipse(side * s.eye_spacing, 0.0, rim, 0.15, self.glasses, width=0.03)
            shapes.line(np.array([[side * (s.eye_spacing + rim), -0.02], [side * 0.98, -0.05]]), self.glasses, 0.03)
        inner = s.eye_spacing - rim
        shapes.line(arc(-inner, inner, -0.03, -0.03), self.glasses, 0.03)
