"""``benchmarks/bench_pipeline.py --quick`` runs end to end and writes its three tables.

The run asserts, inside the script, that the hand-written pipeline's gradients and
parameters (and replicator's parameters) equal one device's before timing them;
its exit status carries that. Here the state table is checked against arithmetic
on the MLP's sizes. The quick run compiles about twenty small programs: 34 s to
4 minutes on a shared 2-core machine, over the 30 s a test may take, so the test
is skipped unless ``REPLICATOR_BENCH_TESTS=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_pipeline.py"


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("REPLICATOR_BENCH_TESTS") != "1",
    reason="the --quick run takes minutes on 2 cores (over 30 s); set REPLICATOR_BENCH_TESTS=1 to run it",
)
def test_quick_run_writes_every_table_and_state_splits_over_stages(tmp_path):
    out = tmp_path / "pipeline.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", "4", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    text = out.read_text()
    for heading in (
        "### 1. Step time, S = 2",
        "### 1b. Stacked scan against one leaf per layer, S = 2, M = 4, 4 rows",
        "### 2. Per-device memory, S = 2",
        "### 3. Parameters and Adam",
    ):
        assert heading in text, heading
    for variant in (
        "rp gpipe, stacked",
        "rp gpipe, one leaf per layer",
        "rp 1f1b, stacked",
        "rp 1f1b, one leaf per layer",
    ):
        assert f"| {variant} |" in text, variant
    # 1b: the stacked form stashes what one leaf per layer stashes (its activations), not its weights.
    stash = {
        line.split(" | ")[0].strip("| "): line.split(" | ")[3]
        for line in text.splitlines()
        if line.startswith("| rp ") and ", " in line.split(" | ")[0]
    }
    assert stash["rp gpipe, stacked"] == stash["rp gpipe, one leaf per layer"], stash
    for m in (1, 2, 4):
        for variant in ("hand GPipe", "hand GPipe, no exchange", "rp gpipe", "rp 1f1b", "rp 1f1b-fused"):
            assert f"| {m} | {variant} |" in text, (m, variant)
    # --quick: 4 layers of a 32x32 weight and a 32 bias, float32; Adam keeps two moments and a step count.
    params = 4 * (32 * 32 + 32) * 4
    adam = 2 * params + 4
    assert f"| replicated | - | - | {params + adam} | 1.00 |" in text
    for stages in (1, 2, 4):  # each stage keeps 4 / S layers and their moments; the count on every device
        d = 4 // stages
        state = params // stages + 2 * params // stages + 4
        line = f"| {stages} | {d} | 0 | {state} | {state / (params + adam):.2f} | {state} |"
        assert line in text, line
        if d > 1:  # ZeRO over the stage's D replicas: 1 the moments, 3 the parameters too, 1/D per device
            for zero, row in ((1, params // stages), (3, params // stages // d)):
                state = row + 2 * params // stages // d + 4
                line = f"| {stages} | {d} | {zero} | {state} | {state / (params + adam):.2f} | {state} |"
                assert line in text, line
