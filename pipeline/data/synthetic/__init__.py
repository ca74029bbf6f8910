"""The synthetic BioVid twin: drawn faces that show pain the way PSPI scores it, in BioVid Part A's exact layout.

Every command defaults to this dataset, so the whole pipeline runs end to end without the licensed data. It writes
``starting_point/samples.csv`` and ``video/<subject>/<sample>.mp4`` (25 fps, 5.5 s) in two looks ("classic": frontal
faces Haar finds; "hard": small, rolled and turned faces in clutter and strong light). Pain follows the PSPI action
units (AU4, AU6/7, AU9/10, AU43), grows from PA1 to PA4 and varies by subject; identity varies too, so leaking
subjects across folds is rewarded. Everything is deterministic from (seed, subject, sample), whatever the number of
workers or resuming. Beside each video, `synthetic_regions/<subject>/<sample>.csv` records per frame the action
units, head roll and yaw, and the box of each PSPI region.

Submodules, in the order data flows through them:

- `settings`: file names, `SyntheticConfig`, `PRESETS`, the seeded random streams.
- `roster`: the subjects (name, response, look) and their samples (class, intensity, timing).
- `animation`: per-frame action units and head pose of one sample (`animate`).
- `drawing`: drawing primitives in face-local coordinates, the batched `Shapes`, yaw, the face -> pixel map.
- `classic_renderer`: `FaceRenderer`, the classic look. `hard_renderer`: `HardFaceRenderer`, the hard look.
- `videos`: one sample's frames (`render_frames`), its mp4 and its per-frame regions table.
- `dataset`: a whole twin written into a folder (`generate`): config check, parallel resumable videos, tables.
"""

from pipeline.data.synthetic.animation import animate
from pipeline.data.synthetic.dataset import generate
from pipeline.data.synthetic.roster import make_samples, make_subjects
from pipeline.data.synthetic.settings import (
    CONFIG_JSON,
    PRESETS,
    REGIONS,
    REGIONS_DIR,
    SAMPLE_TRUTH_CSV,
    SUBJECTS_CSV,
    SyntheticConfig,
)
from pipeline.data.synthetic.videos import regions_path, render_frames

__all__ = [
    "CONFIG_JSON",
    "PRESETS",
    "REGIONS",
    "REGIONS_DIR",
    "SAMPLE_TRUTH_CSV",
    "SUBJECTS_CSV",
    "SyntheticConfig",
    "animate",
    "generate",
    "make_samples",
    "make_subjects",
    "regions_path",
    "render_frames",
]
