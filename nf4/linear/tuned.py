"""nf4.linear's tuned table, read from `tuned.json` beside this file, and the rules that fit it to a shape.

`tuned(device_name, m, backward, n=, k=)` gives the config for M rows of x on a GPU ("" for Triton's
interpreter); `for_shape` adjusts a row to the weight's shape by stated rules; `fallback` gives what a
config runs where its kernel cannot. The named configs are module attributes (GEMV_MMA_WK, DEQUANT, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import LinearConfig

DATA = json.loads(Path(__file__).with_name("tuned.json").read_text())
CONFIGS: dict[str, LinearConfig] = {name: LinearConfig(**entry["fields"]) for name, entry in DATA["configs"].items()}
NAMES: dict[LinearConfig, str] = {config: name for name, config in CONFIGS.items()}
# the names for_shape's rules (and tests) use
GEMV = CONFIGS["GEMV"]
GEMV_TABLE = CONFIGS["GEMV_TABLE"]
GEMV_MMA16 = CONFIGS["GEMV_MMA16"]
GEMV_MMA32 = CONFIGS["GEMV_MMA32"]
GEMV_MMA_WK = CONFIGS["GEMV_MMA_WK"]
GEMV_MMA_WK16 = CONFIGS["GEMV_MMA_WK16"]
GEMV_MMA_WK4 = CONFIGS["GEMV_MMA_WK4"]
GEMV_MMA_WK2 = CONFIGS["GEMV_MMA_WK2"]
WORD_GEMM32 = CONFIGS["WORD_GEMM32"]
WORD_GEMM32_S8 = CONFIGS["WORD_GEMM32_S8"]
WORD_GEMM64 = CONFIGS["WORD_GEMM64"]
WORD_GEMM128 = CONFIGS["WORD_GEMM128"]
WORD_GEMM128_W8 = CONFIGS["WORD_GEMM128_W8"]
WORD_GEMM256 = CONFIGS["WORD_GEMM256"]
DEQUANT = CONFIGS["DEQUANT"]
DEFAULT_GPU: str = DATA["default_gpu"]

Rows = tuple[tuple[int | None, LinearConfig], ...]


def _rows(rows) -> Rows:
    return tuple((limit, CONFIGS[name]) for limit, name in rows)


TUNED: dict[str, dict[str, Rows]] = {
    gpu: {d: _rows(r) for d, r in table.items()} for gpu, table in DATA["rows"].items()}
INTERPRETER: dict[str, Rows] = {d: _rows(r) for d, r in DATA["interpreter"].items()}
TABLE = "table"  # a fallback: the table's choice for the shape without the Gluon rule (for_shape(gluon=False))
FALLBACK: dict[LinearConfig, LinearConfig | Rows | str] = {
    CONFIGS[name]: v if v == TABLE else CONFIGS[v] if isinstance(v, str) else _rows(v)
    for name, v in DATA["fallback"].items()}


def pick(rows: Rows, m: int) -> LinearConfig:
    """The config of the first row whose largest M (None: any) takes m rows of x; the last row's past them all."""
    for limit, config in rows:
        if limit is None or m <= limit:
            return config
    return rows[-1][1]


def fallback(config: LinearConfig, m: int, n: int = 0, k: int = 0, gpu: str = "") -> LinearConfig | None:
    """The tuned fallback of `config` at M rows of x of a weight of n x k on the named GPU (FALLBACK), or None where it
    has none."""
    entry = FALLBACK.get(config)
    if entry == TABLE:
        return tuned(gpu, m, n=n, k=k, gluon=False)
    return pick(entry, m) if isinstance(entry, tuple) else entry


SMALL_WEIGHT = 1024 * 4096
# GPUs whose M = 33-64 row gives way to nf4.dequantize + cuBLAS on rows under 2048 weights: measured over the shape
# catalog (results/catalog/linear_<gpu>.json). Against the word GEMM's time, dequantize + cuBLAS took a median 0.81x
# on the fit subset's 38 rows (2 slower by more than 3 %) and 0.82x on the held-out subset's 10 rows (none slower)
# on the H200; 0.83x (2 slower) and 0.84x (none slower) on the H100
SHORT_ROWS_DEQUANT_64 = ("H200", "H100")
LARGE_WEIGHT = 8192 * 4096  # weights from which the word GEMM rows take rows of 4096-8191 weights


# GPUs whose single-launch GEMV rows (M <= 16) follow the shape catalog's config race,
# `python -m experiments.labs.config_race --configs GEMV_MMA_WK GEMV_MMA_WK16 GEMV_MMA_WK4 GEMV_MMA16 --ms 1 4 8 16
# --shapes all` (results/labs/config_race_catalog_<gpu>.json, judged in config_race_judged_<gpu>.json). The rules below
# were fit on the H100's fit subset. Against the fastest single-launch config raced at each shape and M they are more
# than 10 % slower on 11 of 414 fit rows (the rows before them: 70) and 6 of 200 held-out rows (before: 28); on a
# second H100 run 12 and 4 (66 and 27); on the H200, which they were not fit on, 12 and 4 (70 and 28).
GEMV_RULE_GPUS = ("H100", "H200")
ROW_ALIGN = 256  # bytes: rows whose packed length is not a multiple take GEMV_MMA_WK16's 512-byte K steps
MANY_ROWS = 2304  # weights of at least this many rows (16-row programs: 144 or more) take GEMV_MMA_WK4 at M <= 4
LONG_ROW = 11008  # ... unless their rows are longer than this
TALL = 16384  # M = 9-16: weights of at least this many rows take GEMV_MMA_WK16 (one launch) over GEMV_MMA16


# Per GPU, the rows M = 65-512 that take the Gluon GEMM (kernel "gemm_gluon") on large weights: (largest M, least
# N * K, least N / K, config). H100: the lab kernels raced against nf4.linear over the whole shape catalog at M = 64,
# 128, 256, 512 (`python -m experiments.labs.gluon_gemm --race --shapes catalog`, results/labs/gluon_race_h100.json,
# two runs), fit on the fit subset. H200: nf4.linear with the H100's rows against the table without them over half the
# catalog at M = 96, 128, 256, 512, bf16 and fp16 (`--product`, results/labs/gluon_product_h200.json), the rows'
# thresholds raised to fit its fit subset (its dequantize + cuBLAS is faster). `--fit-rule` fits them again from those
# files (the H200's `--within H100`); `--report-rule` gives both subsets.
GLUON_RULES = {
    "H100": ((128, 8 << 20, 0.0, "GLUON_GEMM128"), (256, 16 << 20, 1.0, "GLUON_GEMM256"),
             (512, 24 << 20, 0.75, "GLUON_GEMM256")),
    "H200": ((128, 16 << 20, 0.25, "GLUON_GEMM128"), (256, 24 << 20, 1.0, "GLUON_GEMM256"),
             (512, 48 << 20, 0.75, "GLUON_GEMM256")),
}


def gluon_rule(m: int, n: int, k: int, gpu: str) -> LinearConfig | None:
    """The Gluon GEMM's config for M rows of x and a weight of n x k on the named GPU, or None (its GLUON_RULES: the
    first row whose largest M takes m, from M = 65; none on other GPUs)."""
    rules = next((r for g, r in GLUON_RULES.items() if g in gpu), None)
    if m <= 64 or rules is None:
        return None
    for limit, least, ratio, name in rules:
        if m <= limit:
            return CONFIGS[name] if n * k >= least and n >= ratio * k else None
    return None


def for_shape(config: LinearConfig, m: int, n: int, k: int, gpu: str = "") -> LinearConfig:
    """The config a tuned row gives way to on a weight of n x k that it fits badly on the named GPU; any other config
    unchanged.

    Rules (from sweeps over six weights on both GPUs, and the catalog's config race where GEMV_RULE_GPUS says; the
    measurements are in tuned.json's sources):
    - M = 17-32: a weight of at most SMALL_WEIGHT weights takes GEMV_MMA32; a large weight (LARGE_WEIGHT or
      more) with rows of 4096-8191 weights WORD_GEMM32_S8.
    - M = 33-64, on the GPUs of SHORT_ROWS_DEQUANT_64: rows shorter than 2048 take DEQUANT.
    - M = 65-128: rows shorter than 4096 take DEQUANT; large weights with rows of 4096-8191 WORD_GEMM128_W8.
    - M = 129-256: rows shorter than 8192 take DEQUANT, except large weights with rows of 4096 or more.
    - M <= 4: 14336-16384 rows of 4096 weights take GEMV_MMA_WK2 (one program of 128 rows per multiprocessor).
    - The single-launch GEMV rows on the GPUs of GEMV_RULE_GPUS: at M <= 8, rows whose packed bytes are not a
      multiple of ROW_ALIGN take GEMV_MMA_WK16; else at M <= 4 a weight of MANY_ROWS rows or more with rows of at
      most LONG_ROW weights takes GEMV_MMA_WK4. At M = 9-16 a weight of TALL rows or more takes GEMV_MMA_WK16.
    - Elsewhere, M <= 4: rows shorter than two steps of a GEMV_MMA_WK warp take GEMV_MMA_WK4.
    """
    large_short = 4096 <= k < 8192 and n * k >= LARGE_WEIGHT
    if config is WORD_GEMM32 and n * k <= SMALL_WEIGHT:
        return GEMV_MMA32
    if config is WORD_GEMM32 and large_short:
        return WORD_GEMM32_S8
    if config is WORD_GEMM64 and k < 2048 and any(g in gpu for g in SHORT_ROWS_DEQUANT_64):
        return DEQUANT
    if (config is WORD_GEMM128 and k < 4096) or (config is WORD_GEMM256 and k < 8192 and not large_short):
        return DEQUANT
    if config is WORD_GEMM128 and large_short:
        return WORD_GEMM128_W8
    raced = any(g in gpu for g in GEMV_RULE_GPUS)
    if config is GEMV_MMA16 and 9 <= m <= 16 and raced and n >= TALL:
        return GEMV_MMA_WK16
    if m > 8 or (config is not GEMV_MMA_WK and config is not GEMV_MMA_WK16):
        return config
    if m <= 4 and k == 4096 and 14336 <= n <= 16384:
        return GEMV_MMA_WK2
    if raced:
        if (k // 2) % ROW_ALIGN:
            return GEMV_MMA_WK16
        if m <= 4 and n >= MANY_ROWS and k <= LONG_ROW:
            return GEMV_MMA_WK4
        return config
    if m <= 4 and k // 2 < 2 * GEMV_MMA_WK.warps_k * 4 * GEMV_MMA_WK.step_bytes:
        return GEMV_MMA_WK4
    return config


def tuned(device_name: str, m: int, backward: bool = False, *, n: int | None = None,
          k: int | None = None, gluon: bool = True) -> LinearConfig:
    """The tuned config for M rows of x on the named GPU ("" for the interpreter); given the weight's n x k, as
    `for_shape` adjusts it for that weight, or (gluon) the Gluon GEMM where `gluon_rule` takes the shape."""
    direction = "backward" if backward else "forward"
    if not device_name:
        return pick(INTERPRETER[direction], m)
    table = next((t for gpu, t in TUNED.items() if gpu in device_name), TUNED[DEFAULT_GPU])
    config = pick(table[direction], m)
    if not backward and n is not None and k is not None:
        rule = gluon_rule(m, n, k, device_name) if gluon else None
        config = rule or for_shape(config, m, n, k, device_name)
    return config
