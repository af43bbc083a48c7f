"""The README's main job leaves the checkout as it found it: its report goes under the ignored build/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.slow  # the main job end to end (about 25 s: make test-long, which CI runs after make test)
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_main_job_writes_no_tracked_file(tmp_path):
    """`python -m verify` (the CPU path, on the quick subset) with no --out: the checkout's status is unchanged,
    and the report is where the README says, under build/."""
    before = _status()
    report = ROOT / "build" / "verify_cpu.json"
    stamp = report.stat().st_mtime_ns if report.exists() else None
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "verify", "--quick", "--no-progress", "--device", "cpu"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _status() == before, "the main job changed the checkout:\n" + _status()
    assert report.exists() and report.stat().st_mtime_ns != stamp, "no report under build/"
