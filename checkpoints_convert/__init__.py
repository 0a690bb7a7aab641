"""Command-line faces of `megatron_async.convert` (the HF <-> Megatron conversion)."""
