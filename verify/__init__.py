"""Checks every implementation against every oracle, bit for bit; reproduces the challenge benchmark.

    python -m verify [--quick] [--out results/verify_<device>.json]

Modules: `cases` (the seeded grid and how each case is built), `impls` (the registry of
implementations), `matrix` (runs and judges every cell), `known` (the known third-party defects, the
only mismatches accepted, each recognised by a model of what the implementation does instead),
`models` (those models, in NumPy), `inductor` (the torch.compile peers), `challenge` (Unsloth puzzle
A: correctness and timing), `report` (tables), `exact` (bit-exact comparison), `timing` (GPU clocks and
provenance), `peers` (the other implementations).
"""
