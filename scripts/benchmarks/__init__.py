"""Benchmark rows, one module per chapter; each exposes ``run(args) -> list[dict]``."""
