"""Benchmark rows, one module per chapter; each exposes ``run(args) -> list[dict]``.

``timing`` is not a chapter: the step timing they all share.
"""
