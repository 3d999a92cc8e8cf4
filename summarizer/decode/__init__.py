"""Layer 5, decoding: search, word rules, int8 and 16-bit forms, readable text, and loading a model to decode."""
