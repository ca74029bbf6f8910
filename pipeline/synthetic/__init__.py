"""The synthetic BioVid twin (being split into submodules; for now all of it is in `classic_renderer`)."""

from pipeline.synthetic.classic_renderer import (
    CONFIG_JSON,
    PRESETS,
    REGIONS,
    REGIONS_DIR,
    SAMPLE_TRUTH_CSV,
    SUBJECTS_CSV,
    SyntheticConfig,
    animate,
    generate,
    make_samples,
    make_subjects,
    regions_path,
    render_frames,
)

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
