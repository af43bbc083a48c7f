"""The fused linear's backward variants (dY @ W): each file registers itself with experiments.registry.

Modules whose names start with "_" are helpers and are not imported as variants.
"""
