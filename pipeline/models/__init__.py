"""The networks and how they train: the backbone adapter and one module per backbone family (`backbone_adapter`,
`backbone_families/`, `backbones`), pretrained-weight resolution, the factory, fine-tuning strategies, heads and
outputs (each a registry), the reference ViT, the LightningModule and its callbacks, a fold's result, the kept model
file, scoring and cost counting."""
