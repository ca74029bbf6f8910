"""What the ViT course notebooks share: faces to look at, patches and embeddings, and the ViT in NumPy alone."""
