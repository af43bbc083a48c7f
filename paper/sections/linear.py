"""results/linear/bench*_<gpu>.json (`python -m experiments bench-linear`): the fused linear against its peers.

Two files per GPU: `bench_<gpu>.json` (bf16, the three weights the bars are set on, M = 1 .. 4096) and
`bench2_<gpu>.json` (fp16, four more weights at a few M). Every row is one (weight, M, provider): its
CUDA-graph device time, the operand and sum checks made before timing (docs/FORMAT.md §9), and the byte
and flop floors of that call. The bars (`BARS`) are evaluated here, from the rows, never typed.
"""

from __future__ import annotations

from paper.latex import (
    DASH,
    NM,
    Document,
    dtype_short,
    integer,
    missing_box,
    number,
    ratio,
    row,
    shape_tex,
    slug,
    stack,
    tex,
    us,
)

# (file tag, macro stem, label): results/linear/bench_<tag>.json and bench2_<tag>.json.
GPUS = (("h100", "HOneHundred", "H100"), ("h200", "HTwoHundred", "H200"))
# The weights the bars are set on, (N, K) = (out_features, in_features) of Llama-3-8B's MLP up (and
# gate) projection, its down projection, and an attention projection; macro stems.
BAR_SHAPES = (((14336, 4096), "Up"), ((4096, 14336), "Down"), ((4096, 4096), "Square"))

NF4 = "nf4.linear"
DENSE = "dense.F.linear(dequantized)"
DEQUANT = "nf4.dequantize+F.linear"
BNB = "bnb.matmul_4bit"
UNSLOTH = "unsloth."  # a prefix: the provider's name carries the release (unsloth.2026.10.9.fast_gemv)
# The columns of the timing tables: provider (or prefix) -> short header. Every one but nf4 and dense
# cuBLAS is an NF4 implementation, a "peer" (the best peer is the fastest of those at a point).
COLUMNS = {NF4: "nf4.linear", BNB: "bnb matmul_4bit", "bnb.gemm_4bit.fused_kernel": "bnb fused kernel",
           "bnb.gemm_4bit.fallback": "bnb fallback", UNSLOTH: "Unsloth fast_gemv",
           "torch.compile(dequantize+linear)": "torch. compile", DEQUANT: "nf4.deq. + cuBLAS",
           DENSE: "dense cuBLAS"}
PEERS = tuple(p for p in COLUMNS if p not in (NF4, DENSE))
PEER_SHORT = {BNB: "bnb", "bnb.gemm_4bit.fused_kernel": "fused", "bnb.gemm_4bit.fallback": "fallback",
              UNSLOTH: "Unsloth", "torch.compile(dequantize+linear)": "compile", DEQUANT: "deq."}
# Rows of the exactness table, in this order (any other provider found follows).
CHECKED = (NF4, "nf4.linear.sweep", "nf4.linear.backward", "nf4.linear.backward.sweep", DENSE, DEQUANT, BNB,
           "bnb.gemm_4bit.fused_kernel", "bnb.gemm_4bit.fallback", UNSLOTH, "torch.compile(dequantize+linear)")
# The providers drawn in the figure (the floor is drawn as well).
PLOTTED = (NF4, BNB, "bnb.gemm_4bit.fused_kernel", DEQUANT, DENSE, UNSLOTH)
PATHS = {"gemv": "gemv", "gemm": "dot", "dequant": "deq."}

# The bars: the targets set for the fused linear (constants, not measurements), M ranges and factors.
SMALL_M, MID_M, LARGE_M = 128, (256, 512), 1024
FLOOR_FACTOR, PEER_FACTOR, MID_FACTOR, DENSE_TOLERANCE = 1.5, 2.0, 1.5, 0.10
# stem -> (label, M test, value of a point, test of the value; the worst point is the one that tests worst)
BARS = {
    "FloorOne": (rf"$M{{=}}1$: device time $\le {FLOOR_FACTOR:g}\times$ the byte floor",
                 lambda m: m == 1, lambda p: _over(p[NF4], p["byte_floor"]), lambda v: v <= FLOOR_FACTOR),
    "PeerOne": (rf"$M{{=}}1$: ${PEER_FACTOR:g}\times$ faster than the best peer",
                lambda m: m == 1, lambda p: _over(p["best"], p[NF4]), lambda v: v >= PEER_FACTOR),
    "DenseSmall": (rf"$M \le {SMALL_M}$: faster than dense cuBLAS",
                   lambda m: m <= SMALL_M, lambda p: _over(p[DENSE], p[NF4]), lambda v: v > 1),
    "DequantMid": (rf"$M = {MID_M[0]}$--${MID_M[1]}$: ${MID_FACTOR:g}\times$ faster than nf4.dequantize + cuBLAS",
                   lambda m: MID_M[0] <= m <= MID_M[1], lambda p: _over(p[DEQUANT], p[NF4]),
                   lambda v: v >= MID_FACTOR),
    "BnbMid": (rf"$M = {MID_M[0]}$--${MID_M[1]}$: ${MID_FACTOR:g}\times$ faster than bnb matmul\_4bit",
               lambda m: MID_M[0] <= m <= MID_M[1], lambda p: _over(p[BNB], p[NF4]), lambda v: v >= MID_FACTOR),
    "DenseLarge": (rf"$M \ge {LARGE_M}$: within {DENSE_TOLERANCE * 100:.0f}\,\% of dense cuBLAS",
                   lambda m: m >= LARGE_M, lambda p: _over(p[NF4], p[DENSE]), lambda v: v <= 1 + DENSE_TOLERANCE),
    "DequantLarge": (rf"$M \ge {LARGE_M}$: never slower than nf4.dequantize + cuBLAS",
                     lambda m: m >= LARGE_M, lambda p: _over(p[NF4], p[DEQUANT]), lambda v: v <= 1),
    "Host": (r"$M{=}1$: host time per call $\le$ an empty Triton JIT launch",
             lambda m: m == 1, lambda p: _over(p["host"], p["jit"]), lambda v: v <= 1),
}
BAR_LETTERS = {"FloorOne": "a", "PeerOne": "a", "DenseSmall": "b", "DequantMid": "c", "BnbMid": "c",
               "DenseLarge": "d", "DequantLarge": "d", "Host": "e"}
NUMERIC = ("N", "K", "M", "graph_us", "host_us", "jit_host_us", "operand_mismatches", "sum_ratio", "byte_floor_us",
           "flop_floor_us", "floor_us", "pct_of_floor")


def _over(a, b):
    return a / b if a is not None and b else None


def load(doc: Document) -> dict | None:
    """{gpu tag: {"bench": payload, "bench2": payload}} for the files present, or None (noted as missing)."""
    return load_per_gpu(doc, (("bench", " bf16 bar weights"), ("bench2", " fp16 weights")), "bench-linear",
                        "fused linear")


def load_per_gpu(doc: Document, kinds, command: str, section: str, folder: str = "linear/") -> dict | None:
    """{gpu tag: {kind: payload}} from results/<folder><kind>_<tag>.json for each (kind, what) of `kinds` (`what`
    follows the GPU's name in the note of a missing file), or None (each missing file noted)."""
    data = {}
    for tag, _, label in GPUS:
        for kind, what in kinds:
            name = f"{folder}{kind}_{tag}.json"
            if not (doc.results / name).exists():
                doc.missing.append(f"results/{name} ({label}{what}: python -m experiments {command})")
                continue
            payload = doc.load(name, label=f"experiments {command}", required_for=f"{section}, {label}")
            if isinstance(payload, dict):
                data.setdefault(tag, {})[kind] = payload
    return data or None


def load_present(doc: Document, name: str, label: str, section: str) -> dict:
    """{gpu tag: payload} of results/<name with {tag}> where present: a lab run or an extra run, so a GPU without one
    gets no note."""
    out = {}
    for tag, _, gpu in GPUS:
        path = name.format(tag=tag)
        if (doc.results / path).exists():
            payload = doc.load(path, label=label, required_for=f"{section}, {gpu}")
            if isinstance(payload, dict):
                out[tag] = payload
    return out


def _rows(payload) -> list[dict]:
    """The dict rows of a bench-linear payload, numeric fields that are not numbers removed."""
    out = []
    for r in (payload or {}).get("rows") or []:
        if not isinstance(r, dict):
            continue
        r = dict(r)
        for key in NUMERIC:
            if key in r:
                v = number(r[key])
                if v is None:
                    del r[key]
                else:
                    r[key] = v
        r["provider"] = str(r.get("provider"))
        r["dtype"] = str(r.get("dtype"))
        out.append(r)
    return out


def _column(provider: str) -> str | None:
    """The COLUMNS key a provider belongs to (the Unsloth one by prefix), or None."""
    if provider in COLUMNS:
        return provider
    return UNSLOTH if provider.startswith(UNSLOTH) else None


def _time(r) -> float | None:
    """Device time of a row, None when it raised or has none."""
    return None if not r or r.get("error") else r.get("graph_us")


def _config(r) -> dict:
    """The LinearConfig a row of nf4.linear recorded (as a dict), or {}."""
    cfg = (r or {}).get("config")
    return cfg if isinstance(cfg, dict) else {}


def _failed(r) -> bool:
    """The operand check ran and failed (-1: the output's shape or dtype was wrong)."""
    v = (r or {}).get("operand_mismatches")
    return v is not None and v != 0


class Bench:
    """The rows of one bench-linear file, indexed by case (N, K, dtype) and M."""

    def __init__(self, payload):
        env = payload.get("env") if isinstance(payload, dict) else None
        self.env = env if isinstance(env, dict) else {}
        self.copy_gbs = number((payload or {}).get("copy_gbs")) if isinstance(payload, dict) else None
        self.tflops = number((payload or {}).get("nominal_tflops")) if isinstance(payload, dict) else None
        self.rows = _rows(payload) if isinstance(payload, dict) else []
        self.by: dict = {}
        for r in self.rows:
            col = _column(r["provider"])
            if col is not None and r.get("M") is not None:
                self.by[(self.case(r), int(r["M"]), col)] = r
        self.cases = list(dict.fromkeys(self.case(r) for r in self.rows if _column(r["provider"])))
        self.ms = {c: sorted({m for (c2, m, _) in self.by if c2 == c}) for c in self.cases}

    @staticmethod
    def case(r):
        return (int(r.get("N") or 0), int(r.get("K") or 0), r["dtype"])

    def get(self, case, m, col) -> dict:
        return self.by.get((case, m, col)) or {}

    def point(self, case, m) -> dict:
        """Times at one (case, M): every column, the best peer and its name, the floors, nf4's host times."""
        p = {col: _time(self.get(case, m, col)) for col in COLUMNS}
        timed = [(p[c], c) for c in PEERS if p[c] is not None]
        p["best"], p["best_name"] = min(timed) if timed else (None, None)
        any_row = next((self.get(case, m, c) for c in COLUMNS if self.get(case, m, c)), {})
        p["byte_floor"], p["flop_floor"] = any_row.get("byte_floor_us"), any_row.get("flop_floor_us")
        nf = self.get(case, m, NF4)
        p["host"], p["jit"] = nf.get("host_us"), nf.get("jit_host_us")
        return p

    def bar_cases(self):
        return [c for c in self.cases if (c[0], c[1]) in {s for s, _ in BAR_SHAPES}]


def build(doc: Document, data: dict | None) -> None:
    """Macros, the timing, bars and exactness tables and the figures of the fused linear."""
    data = data if isinstance(data, dict) else {}
    benches = {tag: Bench((data.get(tag) or {}).get("bench")) for tag, _, _ in GPUS}
    halves = {tag: Bench((data.get(tag) or {}).get("bench2")) for tag, _, _ in GPUS}
    for shape, stem in BAR_SHAPES:
        doc.macro(f"NFlinShape{stem}", shape_tex(shape))
    doc.macro("NFlinBarFloorFactor", f"{FLOOR_FACTOR:g}")
    doc.macro("NFlinBarPeerFactor", f"{PEER_FACTOR:g}")
    doc.macro("NFlinBarMidFactor", f"{MID_FACTOR:g}")
    doc.macro("NFlinBarDenseTolerance", f"{DENSE_TOLERANCE * 100:.0f}")
    doc.macro("NFlinBarSmallM", integer(SMALL_M))
    doc.macro("NFlinBarMidLowM", integer(MID_M[0]))
    doc.macro("NFlinBarMidHighM", integer(MID_M[1]))
    doc.macro("NFlinBarLargeM", integer(LARGE_M))
    bars = {}
    for tag, stem, label in GPUS:
        b, h = benches[tag], halves[tag]
        _env_macros(doc, stem, b, h)
        _point_macros(doc, stem, b, h)
        bars[tag] = _bar_macros(doc, stem, b)
        _exact_macros(doc, stem, b, h)
        _timing_table(doc, f"linear_table_{tag}.tex", b, label, f"bench_{tag}")
        _timing_table(doc, f"linear_half_table_{tag}.tex", h, label, f"bench2_{tag}")
        _figure(doc, tag, b, label)
    _bars_table(doc, benches, bars)
    _exact_table(doc, benches, halves)


# --- macros -----------------------------------------------------------------------------------------


def _env_macros(doc: Document, g: str, b: Bench, h: Bench) -> None:
    env = b.env or h.env
    for key, name in (("device", "Device"), ("torch", "Torch"), ("triton", "Triton"), ("bitsandbytes", "Bnb"),
                      ("cuda", "Cuda")):
        doc.macro(f"NFlin{name}{g}", tex(env[key]) if env.get(key) else NM)
    unsloth = env.get("unsloth")
    doc.macro(f"NFlinUnsloth{g}", tex(unsloth["version"]) if isinstance(unsloth, dict) and unsloth.get("version")
              else NM)
    for bench, name in ((b, "Commit"), (h, "CommitHalf")):
        commit = str(bench.env.get("commit") or "")[:7]
        doc.macro(f"NFlin{name}{g}", tex(commit) if commit else NM)
    copy = b.copy_gbs or h.copy_gbs
    doc.macro(f"NFlinCopyGBs{g}", integer(copy) if copy else NM)
    tflops = b.tflops or h.tflops
    doc.macro(f"NFlinNominalTflops{g}", _num_g(tflops))


def _num_g(x) -> str:
    """A constant recorded in a result file, as short as it prints ('989.4'), or the placeholder."""
    x = number(x)
    return NM if x is None else f"{x:g}"


def _point_macros(doc: Document, g: str, b: Bench, h: Bench) -> None:
    """M = 1 on each bar weight, the kernels' M ranges, how often nf4 beat the best peer, the backward."""
    for (n, k), s in BAR_SHAPES:
        case = next((c for c in b.cases if c[:2] == (n, k)), None)
        p = b.point(case, 1) if case else {}
        doc.macro(f"NFlinUsOneNF{s}{g}", us(p.get(NF4)))
        doc.macro(f"NFlinUsOnePeer{s}{g}", us(p.get("best")))
        doc.macro(f"NFlinPeerOne{s}{g}", tex(COLUMNS[p["best_name"]].replace("torch. ", "torch."))
                  if p.get("best_name") else NM)
        doc.macro(f"NFlinSpeedupOne{s}{g}", ratio(_over(p.get("best"), p.get(NF4))))
        doc.macro(f"NFlinFloorOne{s}{g}", us(p.get("byte_floor")))
        doc.macro(f"NFlinFloorRatioOne{s}{g}", ratio(_over(p.get(NF4), p.get("byte_floor"))))
        for col, name in ((DENSE, "Dense"), (BNB, "Bnb"), (UNSLOTH, "Unsloth"), ("bnb.gemm_4bit.fused_kernel",
                                                                                 "BnbFused")):
            doc.macro(f"NFlinUsOne{name}{s}{g}", us(p.get(col)))
        doc.macro(f"NFlinHostOne{s}{g}", us(p.get("host")))
        doc.macro(f"NFlinJitOne{s}{g}", us(p.get("jit")))
    for bench, name in ((b, ""), (h, "Half")):
        cases = bench.bar_cases() if not name else bench.cases
        pts = [bench.point(c, m) for c in cases for m in bench.ms[c]]
        both = [p for p in pts if p[NF4] is not None and p["best"] is not None]
        doc.macro(f"NFlin{name}CaseCount{g}", integer(len(both)) if bench.rows else NM)
        doc.macro(f"NFlin{name}FasterCount{g}", integer(sum(p[NF4] < p["best"] for p in both)) if bench.rows else NM)
        sp = [p["best"] / p[NF4] for p in both]
        doc.macro(f"NFlin{name}SpeedupPeerMin{g}", ratio(min(sp)) if sp else NM)
        doc.macro(f"NFlin{name}SpeedupPeerMax{g}", ratio(max(sp)) if sp else NM)
        dense = [p[NF4] / p[DENSE] for p in pts if p[NF4] is not None and p[DENSE]]
        doc.macro(f"NFlin{name}DenseRatioMin{g}", ratio(min(dense)) if dense else NM)
        doc.macro(f"NFlin{name}DenseRatioMax{g}", ratio(max(dense)) if dense else NM)
        nf_rows = [bench.get(c, m, NF4) for c in cases for m in bench.ms[c] if bench.get(c, m, NF4)]
        doc.macro(f"NFlin{name}NotTimed{g}", integer(sum(_time(r) is None for r in nf_rows)) if bench.rows else NM)
        doc.macro(f"NFlin{name}NFRows{g}", integer(len(nf_rows)) if bench.rows else NM)
    # Which kernel the table chose, by M (over the bar weights): the largest M of each fused path, the
    # smallest M of nf4.dequantize + cuBLAS.
    paths: dict[str, list[int]] = {}
    for c in b.bar_cases():
        for m in b.ms[c]:
            path = _config(b.get(c, m, NF4)).get("path")
            if path:
                paths.setdefault(path, []).append(m)
    for path, name, pick in (("gemv", "GemvMaxM", max), ("gemm", "DotMaxM", max), ("dequant", "DequantMinM", min)):
        found = paths.get(path)
        doc.macro(f"NFlin{name}{g}", integer(pick(found)) if found else (DASH if b.rows else NM))
    # The backward dY @ W as the table runs it, against dense cuBLAS's dY @ W on the dequantized weight.
    bw = [r for r in b.rows if r["provider"] == "nf4.linear.backward" and _time(r)]
    dense_bw = {(Bench.case(r), r.get("M")): _time(r) for r in b.rows
                if r["provider"] == "dense.matmul(dY, W) backward" and _time(r)}
    ratios = [_time(r) / dense_bw[key] for r in bw if dense_bw.get(key := (Bench.case(r), r.get("M")))]
    doc.macro(f"NFlinBackwardRatioMin{g}", ratio(min(ratios)) if ratios else NM)
    doc.macro(f"NFlinBackwardRatioMax{g}", ratio(max(ratios)) if ratios else NM)
    doc.macro(f"NFlinBackwardPoints{g}", integer(len(ratios)) if ratios else NM)
    sweep = [r for r in b.rows + h.rows if r["provider"].endswith(".sweep")]
    doc.macro(f"NFlinSweepRows{g}", integer(len(sweep)) if sweep else NM)
    doc.macro(f"NFlinSweepExact{g}", integer(sum(r.get("operand_mismatches") == 0 for r in sweep)) if sweep else NM)


def _evaluate(b: Bench, stem: str):
    """One bar on one file: (met, worst (value, case, M) or None, points evaluated, [(case, M) where nf4.linear
    raised], bar weights measured), or None when no point of the bar was measured."""
    _, in_range, value, ok = BARS[stem]
    cases = b.bar_cases()
    vals, untimed = [], []
    for c in cases:
        for m in b.ms[c]:
            if not in_range(m):
                continue
            p = b.point(c, m)
            if p[NF4] is None:
                if b.get(c, m, NF4):  # the row exists and raised: a miss, not an absence
                    untimed.append((c, m))
                continue
            v = value(p)
            if v is not None:
                vals.append((v, c, m))
    if not vals and not untimed:
        return None
    worst = None
    if vals:  # the point furthest toward the wrong side: the largest for an upper bound, else the smallest
        upper = ok(0.0)
        worst = max(vals, key=lambda t: t[0]) if upper else min(vals, key=lambda t: t[0])
    met = not untimed and all(ok(v) for v, _, _ in vals)
    return met, worst, len(vals), untimed, len({c[:2] for c in cases})


def _bar_macros(doc: Document, g: str, b: Bench) -> dict:
    """Each bar's verdict and worst value on one GPU, and how many bars were met; returns the evaluations."""
    results = {}
    for stem in BARS:
        res = _evaluate(b, stem) if b.rows else None
        results[stem] = res
        doc.macro(f"NFlinBar{stem}{g}", ("met" if res[0] else "missed") if res else NM)
        doc.macro(f"NFlinBar{stem}Value{g}", ratio(res[1][0]) if res and res[1] else NM)
    nf_rows = [r for r in b.rows if r["provider"] == NF4 and "operand_mismatches" in r]
    exact = (not any(_failed(r) for r in nf_rows)) if nf_rows else None
    doc.macro(f"NFlinBarExact{g}", NM if exact is None else ("met" if exact else "missed"))
    verdicts = [res[0] for res in results.values() if res] + ([exact] if exact is not None else [])
    doc.macro(f"NFlinBarsRun{g}", integer(len(verdicts)) if verdicts else NM)
    doc.macro(f"NFlinBarsMet{g}", integer(sum(verdicts)) if verdicts else NM)
    return results


def _exact_stats(rows, provider):
    """One provider's rows: how many, how many had the operand check and failed it, the worst count of
    differing outputs, the M of the failed rows, and the largest sum ratio."""
    rs = [r for r in rows if (_column(r["provider"]) or r["provider"]) == provider]
    checked = [r for r in rs if "operand_mismatches" in r]
    failed = [r for r in checked if _failed(r)]
    worst = max((r["operand_mismatches"] for r in failed), default=None)
    sums = [r["sum_ratio"] for r in rs if "sum_ratio" in r]
    return {"rows": len(rs), "checked": len(checked), "failed": len(failed), "worst": worst,
            "failed_ms": sorted({int(r["M"]) for r in failed if r.get("M") is not None}),
            "sum": max(sums) if sums else None}


def _exact_macros(doc: Document, g: str, b: Bench, h: Bench) -> None:
    rows = b.rows + h.rows
    for provider, name in ((NF4, "NF"), (DENSE, "Dense"), (DEQUANT, "Dequant"), (BNB, "Bnb"),
                           ("bnb.gemm_4bit.fused_kernel", "BnbFused"), ("bnb.gemm_4bit.fallback", "BnbFallback"),
                           (UNSLOTH, "Unsloth")):
        st = _exact_stats(rows, provider)
        have = st["checked"] > 0
        doc.macro(f"NFlinOperandRows{name}{g}", integer(st["checked"]) if have else NM)
        doc.macro(f"NFlinOperandFail{name}{g}", integer(st["failed"]) if have else NM)
        doc.macro(f"NFlinOperandWorst{name}{g}", integer(st["worst"]) if st["worst"] is not None
                  else (integer(0) if have else NM))
        doc.macro(f"NFlinOperandFailMaxM{name}{g}", integer(max(st["failed_ms"])) if st["failed_ms"]
                  else (DASH if have else NM))
        doc.macro(f"NFlinSumMax{name}{g}", _sum_cell(st["sum"]) if st["sum"] is not None else NM)
    peers = [r["sum_ratio"] for r in rows if _column(r["provider"]) in PEERS and "sum_ratio" in r]
    doc.macro(f"NFlinSumMaxPeers{g}", _sum_cell(max(peers)) if peers else NM)


def _sum_cell(x) -> str:
    x = number(x)
    return NM if x is None else (integer(x) if x >= 100 else ratio(x))


# --- tables and figures ----------------------------------------------------------------------------


def _cell(r) -> str:
    """A provider's device time at a point: err (raised), graph (not capturable in a CUDA graph), or
    the time; a failed operand check adds a star."""
    if not r:
        return DASH
    if r.get("error"):
        return "err"
    t = r.get("graph_us")
    text = us(t) if t is not None else ("graph" if r.get("graph_error") else DASH)
    return text + (r"$^{\ast}$" if _failed(r) else "")


def _timing_table(doc: Document, name: str, b: Bench, label: str, source: str) -> None:
    """Device time of nf4.linear and every provider at each (weight, M) of one file, the best peer, the speedup."""
    if not b.cases:
        doc.write(name, missing_box(rf"results/linear/{tex(source)}.json (\texttt{{python -m experiments "
                                    r"bench-linear} on the " + tex(label) + ")"))
        return
    cols = list(COLUMNS)
    ncol = 4 + len(cols) + 2  # M, path, two floors, the columns, best peer and speedup
    lines = [rf"\begin{{tabular}}{{@{{}}r l r r {'r ' * len(cols)}l r@{{}}}}", r"\toprule",
             r" & & \multicolumn{2}{c}{floor} & \multicolumn{" + str(len(cols)) + r"}{c}{device time ($\mu$s)}"
             r" & \multicolumn{2}{c}{best peer} \\",
             rf"\cmidrule(lr){{3-4}}\cmidrule(lr){{5-{4 + len(cols)}}}\cmidrule(lr){{{5 + len(cols)}-{6 + len(cols)}}}",
             r"$M$ & path & bytes & flops & " + " & ".join(stack(COLUMNS[c], max_line=9) for c in cols)
             + r" & name & $\times$ \\"]
    for case in b.cases:
        lines.append(r"\midrule")
        lines.append(rf"\multicolumn{{{ncol}}}{{@{{}}l}}{{\textit{{{shape_tex(case[:2])} "
                     rf"{tex(dtype_short(case[2]))}}}}} \\")
        for m in b.ms[case]:
            p = b.point(case, m)
            cfg = _config(b.get(case, m, NF4))
            path = DASH
            if cfg.get("path"):
                path = tex(PATHS.get(cfg["path"], cfg["path"])) + (r"$^{s}$" if cfg.get("swap") and
                                                                   cfg["path"] == "gemm" else "")
            best = tex(PEER_SHORT[p["best_name"]]) + (r"$^{\ast}$" if _failed(b.get(case, m, p["best_name"]))
                                                      else "") if p["best_name"] else DASH
            lines.append(row([integer(m), path, us(p["byte_floor"]) if p["byte_floor"] else DASH,
                              us(p["flop_floor"]) if p["flop_floor"] else DASH]
                             + [_cell(b.get(case, m, c)) for c in cols]
                             + [best, ratio(_over(p["best"], p[NF4])) if p["best"] and p[NF4] else DASH]))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write(name, "\n".join(lines) + "\n")


def _bars_table(doc: Document, benches: dict, bars: dict) -> None:
    shown = [(tag, label) for tag, _, label in GPUS if benches[tag].rows]
    if not shown:
        doc.write("linear_bars_table.tex", missing_box(r"results/linear/bench\_<gpu>.json (\texttt{python -m "
                                                       r"experiments bench-linear} on a GPU)"))
        return
    lines = [r"\begin{tabular}{@{}l >{\raggedright\arraybackslash}p{4.6cm} "
             + r">{\raggedright\arraybackslash}p{3.6cm} " * len(shown) + "@{}}", r"\toprule",
             " & bar & " + " & ".join(tex(label) for _, label in shown)
             + r" \\", r"\midrule"]
    for stem, (label, *_) in BARS.items():
        cells = [f"({BAR_LETTERS[stem]})", label]
        for tag, _ in shown:
            cells.append(_bar_cell(bars[tag].get(stem)))
        lines.append(row(cells))
    cells = ["", r"every nf4.linear row passes the operand check"]
    for tag, _ in shown:
        rows = [r for r in benches[tag].rows if r["provider"] == NF4 and "operand_mismatches" in r]
        bad = sum(_failed(r) for r in rows)
        cells.append(NM if not rows else (rf"met ({integer(len(rows))} rows)" if not bad
                                          else rf"\textbf{{missed}} ({integer(bad)} of {integer(len(rows))} rows)"))
    lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("linear_bars_table.tex", "\n".join(lines) + "\n")


def _bar_cell(res) -> str:
    if not res:
        return NM
    met, worst, count, untimed, shapes = res
    text = "met" if met else r"\textbf{missed}"
    if worst is not None:
        v, c, m = worst
        text += rf": {ratio(v)}$\times$ ({shape_tex(c[:2])}, $M{{=}}{m}$)"
    if untimed:
        text += rf"; no nf4 time at {integer(len(untimed))} of {integer(len(untimed) + count)} points"
    if shapes < len(BAR_SHAPES):
        text += rf"; {integer(shapes)} of {integer(len(BAR_SHAPES))} weights measured"
    return text


def _exact_table(doc: Document, benches: dict, halves: dict) -> None:
    shown = [(tag, label) for tag, _, label in GPUS if benches[tag].rows or halves[tag].rows]
    if not shown:
        doc.write("linear_exact_table.tex", missing_box(r"results/linear/bench*\_<gpu>.json (operand and sum "
                                                        r"checks of \texttt{python -m experiments bench-linear})"))
        return
    rows = {tag: benches[tag].rows + halves[tag].rows for tag, _ in shown}
    found = list(dict.fromkeys(_column(r["provider"]) or r["provider"] for t in rows for r in rows[t]))
    providers = [p for p in CHECKED if p in found] + [p for p in found if p not in CHECKED]
    head = " & ".join(rf"\multicolumn{{4}}{{c}}{{{tex(label)}}}" for _, label in shown)
    rule = "".join(rf"\cmidrule(lr){{{2 + 4 * i}-{5 + 4 * i}}}" for i in range(len(shown)))
    lines = [r"\begin{tabular}{@{}l " + "r r r r " * len(shown) + "@{}}", r"\toprule",
             rf"provider & {head} \\", rule,
             " & " + " & ".join([r"checked & failed & worst & sum"] * len(shown)) + r" \\", r"\midrule"]
    for prov in providers:
        name = COLUMNS.get(prov, prov).replace("torch. ", "torch.")
        if prov == UNSLOTH:
            name = "Unsloth fast_gemv"
        cells = [tex(name)]
        for tag, _ in shown:
            st = _exact_stats(rows[tag], prov)
            if not st["rows"]:
                cells += [DASH] * 4
                continue
            if not st["checked"]:  # rows without a check (the dense backward, rows that raised first)
                cells += [integer(0), DASH, DASH, _sum_cell(st["sum"]) if st["sum"] is not None else DASH]
                continue
            worst = DASH if not st["failed"] else (integer(st["worst"]) if st["worst"] and st["worst"] > 0
                                                  else "shape")
            s = _sum_cell(st["sum"]) if st["sum"] is not None else DASH
            if st["sum"] is not None and st["sum"] > 1:
                s = rf"\textbf{{{s}}}"
            cells += [integer(st["checked"]), integer(st["failed"]), worst, s]
        lines.append(row(cells))
    lines += [r"\bottomrule", r"\end{tabular}"]
    doc.write("linear_exact_table.tex", "\n".join(lines) + "\n")


def _figure(doc: Document, tag: str, b: Bench, label: str) -> None:
    """Device time against M on the first bar weight, log-log, with the floor (max of bytes and flops)."""
    (n, k), _ = BAR_SHAPES[0]
    case = next((c for c in b.cases if c[:2] == (n, k)), None)
    name = f"fig_linear_{tag}.tex"
    if case is None:
        doc.write(name, missing_box(rf"{shape_tex((n, k))} in results/linear/bench\_{tag}.json ({tex(label)})"))
        return
    marks = ["*", "square*", "triangle*", "diamond*", "o", "pentagon*"]
    plots = []
    for i, col in enumerate(PLOTTED):
        pts = [(m, _time(b.get(case, m, col))) for m in b.ms[case]]
        pts = [(m, t) for m, t in pts if t is not None]
        if not pts:
            continue
        dat = f"linear_{tag}_{slug(col)}.dat"
        doc.write(dat, "m us\n" + "".join(f"{m} {t:.3f}\n" for m, t in pts))
        style = "very thick" if col == NF4 else "thin"
        legend = COLUMNS[col].replace("torch. ", "torch.")
        plots.append(rf"\addplot+[{style}, mark={marks[i % len(marks)]}] table[x=m, y=us] {{generated/{dat}}};"
                     + "\n" + rf"\addlegendentry{{{tex(legend)}}}")
    floor = [(m, b.point(case, m)) for m in b.ms[case]]
    floor = [(m, max(x for x in (p["byte_floor"], p["flop_floor"]) if x is not None)) for m, p in floor
             if p["byte_floor"] is not None or p["flop_floor"] is not None]
    if floor:
        dat = f"linear_{tag}_floor.dat"
        doc.write(dat, "m us\n" + "".join(f"{m} {t:.3f}\n" for m, t in floor))
        plots.append(rf"\addplot[dashed, black] table[x=m, y=us] {{generated/{dat}}};" + "\n"
                     + r"\addlegendentry{floor (bytes or flops)}")
    if not plots:
        doc.write(name, missing_box(rf"timed points of {shape_tex((n, k))} ({tex(label)})"))
        return
    body = [r"\begin{tikzpicture}",
            r"\begin{axis}[width=\linewidth, height=6cm, xmode=log, ymode=log, log basis x=2,",
            rf"  xlabel={{$M$ (rows of $x$), {shape_tex((n, k))} {tex(dtype_short(case[2]))}}},",
            r"  ylabel={device time ($\mu$s)},",
            r"  legend style={font=\scriptsize, at={(0.5,-0.22)}, anchor=north, legend columns=2}, grid=major,",
            r"  tick label style={font=\footnotesize}, log ticks with fixed point]"]
    doc.write(name, "\n".join(body + plots + [r"\end{axis}", r"\end{tikzpicture}"]) + "\n")
