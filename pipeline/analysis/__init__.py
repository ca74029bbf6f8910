"""What people look at after training: the backbone comparison, inspection (attention rollout, Grad-CAM, region
scores), the calculator report, the augmentation preview and the benchmarks."""
