"""The format's own constants, computed from reference/: the codebook table and what a rebuild of it gives."""

from __future__ import annotations

import functools

from paper.latex import DASH, Document, integer, row


def build(doc: Document) -> None:
    """The codebook table and the format's derived constants (computed from reference/, cached)."""
    table, macros = _format_facts()
    doc.write("codebook_table.tex", table)
    for name, value in macros:
        doc.macro(name, value)


@functools.cache
def _format_facts() -> tuple[str, tuple]:
    """(codebook table, ((macro, value), ...)) computed from reference/: no measurement, no device."""
    import numpy as np

    import reference
    from reference.binsearch import LUT_SIZE, build_quantize_lut, lut_index
    from reference.codebook import dynamic_map
    from reference.format import DYNAMIC_MAP, NF4_CODE, NF4_CODE_BITS

    def ulps(a, b):
        return a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)

    def differ(a, b) -> int:
        return int((a.view(np.uint32) != b.view(np.uint32)).sum())

    rounded = np.round(NF4_CODE.astype(np.float64), 4).astype(np.float32)
    off4 = ulps(rounded, NF4_CODE)
    rebuild64 = ulps(reference.nf4_code_from_normal(float32_grid=False), NF4_CODE)
    rebuild32 = ulps(reference.nf4_code_from_normal(float32_grid=True), NF4_CODE)
    lines = [r"\begin{tabular}{@{}r l l r@{\qquad}r l l r@{}}", r"\toprule",
             r"$i$ & float32 value & bits & 4-dec. & $i$ & float32 value & bits & 4-dec. \\", r"\midrule"]
    for i in range(8):
        cells = []
        for j in (i, i + 8):
            cells += [str(j), f"${float(NF4_CODE[j])!r}$", f"\\texttt{{{NF4_CODE_BITS[j]:08X}}}", integer(off4[j])]
        lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]

    on, off = dynamic_map(contract=True), dynamic_map(contract=False)
    lut = build_quantize_lut(DYNAMIC_MAP)
    never = sorted(set(range(256)) - {int(v) for v in lut})
    macros = (
        ("NFroundedCodebookWrong", integer(int((off4 != 0).sum()))),
        ("NFroundedCodebookMaxUlp", integer(int(np.abs(off4).max()))),
        ("NFrebuildSixtyFourWrong", integer(int((rebuild64 != 0).sum()))),
        ("NFrebuildSixtyFourMaxUlp", integer(int(np.abs(rebuild64).max()))),
        ("NFrebuildThirtyTwoWrong", integer(int((rebuild32 != 0).sum()))),
        ("NFdynmapContractDiffer", integer(differ(on, off))),
        ("NFdynmapContractMaxUlp", integer(int(np.abs(ulps(on, off)).max()))),
        ("NFdynmapStoredVsContract", integer(differ(on, DYNAMIC_MAP))),
        ("NFdynmapStoredVsPlain", integer(differ(off, DYNAMIC_MAP))),
        ("NFlutSize", integer(LUT_SIZE)),
        ("NFlutNeverCount", integer(len(never))),
        ("NFlutNeverFirst", integer(never[0]) if never else DASH),
        ("NFlutNeverLast", integer(never[-1]) if never else DASH),
        ("NFlutZeroIndex", integer(int(lut[int(lut_index(np.float32(0.0)))]))),
        ("NFlutExactZeroIndex", integer(int(np.flatnonzero(DYNAMIC_MAP.view(np.uint32) == 0)[0]))),
    )
    return "\n".join(lines) + "\n", macros
