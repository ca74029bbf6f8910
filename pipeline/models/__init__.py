"""The networks and how they train: backbone adapters over timm and transformers, pretrained-weight resolution
(kept beside the architectures, as timm does), the reference ViT, the LightningModule and its callbacks, the kept fold
model, and cost counting."""
