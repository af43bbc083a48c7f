"""One file per kernel variant; each registers itself with experiments.registry on import.

Modules whose names start with "_" are helpers and are not imported as variants.
"""
