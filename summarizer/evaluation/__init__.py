"""Layer 6, evaluation: ROUGE and text measures, and the `eval` command."""
