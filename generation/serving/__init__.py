"""Many requests at once: the batched engine, its ragged KV cache, per-row verification."""
