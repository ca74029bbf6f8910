"""From BioVid (or its synthetic twin) on disk to batches: the layout, videos, faces and crops, fold files, tasks,
augmentation and the Lightning DataModule."""
