"""Layer 2, data: the tokenizer, pairs files, prepared splits, batches, and the training-time text transforms."""
