"""A runtime that knows nothing of the project: the exported `.onnx` and its `.json` contract, read with json, NumPy,
OpenCV and ONNX Runtime alone (tests/test_onnx_contract.py checks that this module imports nothing else). It is what a
third party would write from the contract, and the tests hold its answers against the project's."""

from __future__ import annotations

import json

import cv2
import numpy as np
import onnxruntime


def network_input(contract: dict, crop_rgb: np.ndarray) -> np.ndarray:
    """The evaluation transform, step by step as the contract lists them: an RGB crop -> (3, H, W) float32."""
    image = crop_rgb
    for step in contract["transform"]:
        name = step["step"]
        if "from_hw" in step and list(image.shape[:2]) != step["from_hw"]:
            raise ValueError(f"{name}: the contract is for {step['from_hw']} px, got {list(image.shape[:2])}")
        if name == "central_crop":
            x0, y0, x1, y1 = step["box_xyxy"]
            image = image[y0:y1, x0:x1]
        elif name == "resize":
            height, width = step["to_hw"]
            image = cv2.resize(image, (width, height), interpolation=getattr(cv2, step["interpolation"]))
        elif name == "normalize":
            mean, std = np.float32(step["mean"]), np.float32(step["std"])
            image = (image.astype(np.float32) - np.float32(255) * mean) / (np.float32(255) * std)
        elif name == "layout":
            image = np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32)
        else:
            raise ValueError(f"unknown transform step {name!r}")
    return image


class ContractRuntime:
    """The contract at `json_path` and a session of the ONNX file beside it."""

    def __init__(self, json_path) -> None:
        with open(json_path, encoding="utf-8") as handle:
            self.contract = json.load(handle)
        onnx_path = str(json_path)[: -len(".json")] + ".onnx"
        self.session = onnxruntime.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])

    # the face crop: a video frame -> the crop as the crop stage writes it -> the RGB crop the project scores on
    def aligned_crop(self, frame_bgr: np.ndarray, landmarks_xy: np.ndarray) -> np.ndarray:
        face = self.contract["face_crop"]
        crop = face["crop"]
        if crop["method"] != "aligned":
            raise ValueError(f"this contract crops by {crop['method']!r}, not by landmarks")
        source = np.asarray(landmarks_xy, dtype=np.float64).reshape(5, 2)
        target = np.asarray(crop["target_points_xy"], dtype=np.float64)
        p, q = source.mean(axis=0), target.mean(axis=0)
        covariance = (target - q).T @ (source - p) / 5
        u, d, vt = np.linalg.svd(covariance)
        e = np.diag([1.0, -1.0 if np.linalg.det(u) * np.linalg.det(vt) < 0 else 1.0])
        rotation = u @ e @ vt
        scale = np.trace(np.diag(d) @ e) / (((source - p) ** 2).sum() / 5)
        matrix = np.hstack([scale * rotation, (q - scale * rotation @ p)[:, None]])
        size = int(face["crop_size"])
        warped = cv2.warpAffine(frame_bgr, matrix, (size, size), flags=getattr(cv2, crop["interpolation"]),
                                borderMode=getattr(cv2, crop["border_mode"]))
        return self.jpeg_round_trip(warped)

    def square_crop(self, frame_bgr: np.ndarray, box_xyxy) -> np.ndarray:
        face = self.contract["face_crop"]
        crop = face["crop"]
        if crop["method"] != "square":
            raise ValueError(f"this contract crops by {crop['method']!r}, not by a box")
        x1, y1, x2, y2 = (float(v) for v in box_xyxy)
        x, y, w, h = round(x1), round(y1), max(1, round(x2 - x1)), max(1, round(y2 - y1))
        side = max(1, round(max(w, h) * (1 + 2 * float(face["margin"]))))
        left, top = int(np.floor(x + w / 2 - side / 2)), int(np.floor(y + h / 2 - side / 2))
        height, width = frame_bgr.shape[:2]
        inside = frame_bgr[max(0, top): min(height, top + side), max(0, left): min(width, left + side)]
        pads = (max(0, -top), max(0, top + side - height), max(0, -left), max(0, left + side - width))
        if any(pads):
            inside = cv2.copyMakeBorder(inside, *pads, borderType=getattr(cv2, crop["border_mode"]))
        size = int(face["crop_size"])
        if side != size:
            flag = crop["shrink_interpolation"] if side > size else crop["grow_interpolation"]
            inside = cv2.resize(inside, (size, size), interpolation=getattr(cv2, flag))
        return self.jpeg_round_trip(np.ascontiguousarray(inside))

    def jpeg_round_trip(self, crop_bgr: np.ndarray) -> np.ndarray:
        quality = int(self.contract["face_crop"]["jpeg"]["quality"])
        ok, encoded = cv2.imencode(".jpg", crop_bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
        assert ok
        return cv2.cvtColor(cv2.imdecode(encoded, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)

    @staticmethod
    def read_crop(path) -> np.ndarray:
        """A crop-stage JPEG file as the RGB crop."""
        return cv2.cvtColor(cv2.imread(str(path), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)

    def network_input(self, crop_rgb: np.ndarray) -> np.ndarray:
        return network_input(self.contract, crop_rgb)

    # the network and its output
    def class_probabilities(self, inputs: np.ndarray) -> np.ndarray:
        outputs = self.session.run([self.contract["output"]], {self.contract["input"]: inputs})[0]
        if self.contract["output"] == "level_probabilities":  # an ordinal or regression model's: read as they are
            return outputs
        logits = outputs
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)

    def pain_probabilities(self, crops_rgb) -> np.ndarray:
        """A frame model: each crop's 1 - P(BL1); an ordinal or regression model's: the sum of its level
        probabilities over the levels >= its output's pain_level."""
        probabilities = self.class_probabilities(np.stack([self.network_input(crop) for crop in crops_rgb]))
        settings = self.contract.get("output_settings")  # an ordinal or regression model's output
        if settings:
            return probabilities[:, int(settings["pain_level"]):].sum(axis=1)
        return 1.0 - probabilities[:, self.contract["class_names"].index("BL1")]

    def window_pain_probabilities(self, crops_rgb, times_s=None) -> np.ndarray:
        """A clip model: each crop scored with a clip of `clip_frames` crops ending with it. With `clip_spacing_s`
        and the crops' times: for each of the times t, t - s, ..., t - (T - 1) s the nearest crop no older than a
        spacing before the earliest of them, each crop once, in time order; else the last `clip_frames` crops."""
        length = int(self.contract["clip_frames"])
        spacing = self.contract.get("clip_spacing_s")
        inputs = [self.network_input(crop) for crop in crops_rgb]
        out = []
        for end in range(1, len(inputs) + 1):
            if spacing and times_s is not None:
                now = float(times_s[end - 1])
                oldest = now - length * float(spacing)
                candidates = [i for i in range(end) if float(times_s[i]) >= oldest]
                picks: list[int] = []
                for step in reversed(range(length)):
                    target = now - step * float(spacing)
                    nearest = min(candidates, key=lambda i: (abs(float(times_s[i]) - target), i))
                    if not picks or nearest > picks[-1]:
                        picks.append(nearest)
            else:
                picks = list(range(max(0, end - length), end))
            clip = np.stack([inputs[i] for i in picks])[None]
            out.append(1.0 - self.class_probabilities(clip)[0, self.contract["class_names"].index("BL1")])
        return np.array(out)

    def decisions(self, probabilities: np.ndarray) -> np.ndarray:
        return np.asarray(probabilities) >= float(self.contract["threshold"])
