"""Command-line faces of `megatron_async.learner.convert` (the HF <-> Megatron conversion)."""
