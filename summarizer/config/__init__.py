"""Layer 1, the config: the typed schema, its checks, loading, and what may change on resume."""
