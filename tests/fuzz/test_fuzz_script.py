"""``scripts/fuzz.py``, the long-run command: what it prints, and a summary when stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "fuzz.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_one_program_is_checked_and_summarised():
    proc = start("--programs", "1", "--seed", "3", "--variants", "default")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "checked 1 programs (seeds 3..3) x 2 meshes" in out, out
    assert "default             2 runs     0 mismatches     0 crashes" in out, out


def test_sigterm_ends_a_long_run_after_the_program_under_way_with_the_summary():
    proc = start("--programs", "1000", "--seed", "0", "--variants", "default")
    first = proc.stdout.readline()
    assert first.startswith("fuzzing 1000 programs from seed 0"), first
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopping after the program under way" in out, out
    # how many programs finished before the signal depends on the machine's speed, not on the script
    checked = re.search(r"checked (\d+) programs \(seeds 0\.\.(\d+)\) x 2 meshes", out)
    assert checked and "(stopped by a signal)" in out, out
    n = int(checked.group(1))
    assert 1 <= n < 1000 and int(checked.group(2)) == n - 1, out
    assert re.search(rf"default +{2 * n} runs +0 mismatches +0 crashes", out), out
