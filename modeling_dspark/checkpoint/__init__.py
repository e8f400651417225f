"""What a drafter checkpoint is: configurations, models, heads, the draft vocabulary, the DeepSpec format and
the remote code a saved folder carries. These modules (with ``generation.decoding``) are the checkpoint's payload."""
