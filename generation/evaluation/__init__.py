"""How it is measured: the paper's tables and figures, batch-1 speed, throughput under load, shared prompt helpers."""
