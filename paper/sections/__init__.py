"""The sections of `python -m paper.generate`, one module each; `paper.generate` runs them in order.

Each module has `build(doc, ...)`, which defines its macros and writes its files on a `paper.latex.Document`,
and, where it reads inputs of its own, `load(doc)`. No section imports another: what two of them share lives in
`paper.latex`, or here when it is a fact about the measurements rather than about LaTeX.
"""

# The weights the probe (python -m experiments probe) times; the tuning labs (results/tuning/) were
# timed on the same ones, and the tuning section quotes them at the middle one, so both sections take
# the list from here.
PROBE_CASES = ("8192x2048:fp16", "14336x4096:bf16", "28672x8192:bf16")
