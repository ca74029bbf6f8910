"""A personalised model's person: `make predict REFERENCE=<folder>`.

A model trained under a personalisation protocol (`personalise=baseline|subject_normalised`, its kept file's
`meta["personalise"]`) scores a crop against the person's own recordings, as its cross-validation did: a baseline
model sees each crop's features minus the mean of the person's resting (BL1) recordings, a subject-normalised one
standardised by the mean and spread of the person's unlabelled recordings. Here those recordings are the files of
`REFERENCE=`: videos (searched for the face, followed, cropped and embedded by the model's own backbone, at
predict's frame rate) or `.npy` embeddings (N, D) made the same way. Which videos are resting ones is the user's to
say; nothing here reads a label. A personalised model without a reference, and a plain one given one, are errors
that say what to do, never a score on the wrong scale.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.data.personalise import no_reference, reference_statistics
from pipeline.deployment.video_frames import PredictError, sampled_frames, shown
from pipeline.models.scoring import FrameScorer


def video_embeddings(scorer: FrameScorer, path: Path, fps: float) -> np.ndarray:
    """The backbone features (N, D) of the followed face in every sampled frame of a reference video; a video
    without any face is an error naming it (a reference must show the person)."""
    follower = scorer.follower()
    parts = []
    for _, _, frames in sampled_frames(path, fps):
        faces = [follower.step(found) for found in scorer.find_faces(frames)]
        crops = [scorer.crop(frame, face) for frame, face in zip(frames, faces, strict=True) if face is not None]
        if crops:
            parts.append(scorer.embeddings(crops))
    if not parts:
        raise PredictError(f"reference recording {shown(path)}: no face found in any sampled frame")
    return np.concatenate(parts)


def attach_reference(scorer: FrameScorer, folder: str | None, fps: float) -> str | None:
    """Give a personalised `scorer` the person of `folder` (`scorer.reference`); returns the line to print, None for
    a plain model without one. A personalised model without a folder, or a plain model with one, is a PredictError
    that says which and what to give."""
    protocol = scorer.personalise
    if not protocol.personal:
        if folder:
            raise PredictError(f"REFERENCE={folder}: this model is not personalised (personalise=none), it scores "
                               f"every person alike and takes no reference; drop REFERENCE=")
        return None
    if not folder:
        raise PredictError(no_reference(protocol))
    try:
        reference = reference_statistics(Path(folder).expanduser(), embed=lambda path: video_embeddings(scorer, path,
                                                                                                        fps))
    except ValueError as error:
        raise PredictError(str(error)) from None
    scorer.reference = reference
    return (f"reference {shown(reference.folder)}: {reference.n_recordings} recordings, {reference.n_rows} face "
            f"crops ({protocol.label})")
