"""Megatron <-> HF weights: the one name/layout mapping (`mapping`), and the weight sync built on it."""
