"""The fused linear's variants (x @ W^T): one file per family; each registers itself with experiments.registry.

Modules whose names start with "_" are helpers and are not imported as variants.
"""
