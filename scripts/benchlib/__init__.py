"""Plumbing the benchmark scripts share: device facts, results files, measured ceilings.

Scripts under `scripts/` import it as `benchlib` (their own directory is on `sys.path` when run).
"""
