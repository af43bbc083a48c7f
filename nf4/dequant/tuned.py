"""The dequantize kernel's tuned table, read from `tuned.json` beside this file.

Rows per GPU (a substring of the device name): (largest output bytes or None, DequantConfig).
Where a GPU has no rows of its own, the default GPU's apply.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import DequantConfig

DATA = json.loads((Path(__file__).with_name("tuned.json")).read_text())
DEFAULT_GPU: str = DATA["default_gpu"]
TUNED: dict[str, tuple[tuple[int | None, DequantConfig], ...]] = {
    gpu: tuple((limit, DequantConfig(**fields)) for limit, fields in entry["rows"])
    for gpu, entry in DATA["gpus"].items()
}


def tuned(device_name: str, out_bytes: int) -> DequantConfig:
    """The tuned config for a weight whose output has `out_bytes` bytes on the named GPU."""
    rows = next((rows for gpu, rows in TUNED.items() if gpu in device_name), TUNED[DEFAULT_GPU])
    for limit, config in rows:
        if limit is None or out_bytes <= limit:
            return config
    return rows[-1][1]
