"""Layer 3, the model: the copy-attention Transformer (pure math), its dropout, and checkpoints."""
