"""Ablations of the NF4 dequantization kernel, llm.c dev/cuda style: numbered variants in one registry.

    python -m experiments list
    python -m experiments run [ids or globs...] [--cases 8192x2048:fp16 ...] [--check-only] [--sm75]

Every variant is one file in `experiments/variants/` that registers itself (`experiments.registry`);
the runner (`experiments.runner`) checks each one bit-exact before it times it. See README.md.
Importing this package has no side effects: `__main__` chooses Triton's interpreter when there is
no GPU, before anything imports triton.
"""
