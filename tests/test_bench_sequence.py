"""``benchmarks/bench_sequence.py``'s reading of XLA's buffer assignment: the residual stream's temporaries.

The script's figures (BENCHMARKS.md) rest on :func:`residual_stream_bytes`: of the newest dump of a module, the
temporary allocations only (not parameters, constants or outputs), the values of the given shapes in any layout,
each byte of an allocation counted once however many values reuse it. Checked here on a buffer assignment
written by hand in XLA's format (a compile-free test; the script itself runs the compiles).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sequence.py"

ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[2,2,4]| at ShapeIndex {}:
 value: <1 x.1 @0> (size=64,offset=0): f32[2,2,4]{2,1,0}
allocation 1: size 256, preallocated-temp:
 value: <2 fusion.1 @0> (size=64,offset=0): f32[2,2,4]{2,1,0}
 value: <3 reduce_scatter.2 @0> (size=64,offset=32): f32[2,2,4]{2,0,1}
 value: <4 dot.3 @0> (size=64,offset=128): f32[4,4]{1,0}
 value: <5 wrapped_copy @0> (size=64,offset=192): f32[2,2,4]{2,1,0}
allocation 2: size 64, thread-local:
 value: <6 fusion.4 @0> (size=64,offset=0): f32[2,2,4]{2,1,0}
allocation 3: size 64, output shape is |f32[2,2,4]|, maybe-live-out:
 value: <7 add.5 @0> (size=64,offset=0): f32[2,2,4]{2,1,0}
allocation 4: size 4, constant:
 value: <8 constant.1 @0> (size=4,offset=0): f32[]

Total bytes: 452
 value: <9 listed.after.the.total @0> (size=999,offset=0): f32[2,2,4]{2,1,0}
"""


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_sequence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(dump: Path, number: int, module: str, text: str) -> None:
    (dump / f"module_{number:04d}.{module}.cpu_after_optimizations-buffer-assignment.txt").write_text(text)


def test_each_byte_of_a_temporary_is_counted_once_in_any_layout(bench, tmp_path):
    _write(tmp_path, 7, "jit_local_step", ASSIGNMENT)
    # allocation 1: [0, 64) and [32, 96) overlap (96 bytes), [192, 256) (64); allocation 2: [0, 64). Not the
    # parameter, the output, the f32[4,4] value, nor what follows the total.
    assert bench.residual_stream_bytes(str(tmp_path), "jit_local_step", {"f32[2,2,4]"}) == 96 + 64 + 64
    assert bench.residual_stream_bytes(str(tmp_path), "jit_local_step", {"f32[4,4]"}) == 64
    assert bench.residual_stream_bytes(str(tmp_path), "jit_local_step", {"f32[8]"}) == 0


def test_the_newest_dump_of_the_module_is_read(bench, tmp_path):
    _write(tmp_path, 7, "jit_local_step", ASSIGNMENT)
    _write(tmp_path, 9, "jit_local_step", ASSIGNMENT.replace("offset=192", "offset=64"))  # [0, 128): 128 bytes
    _write(tmp_path, 11, "jit_other", ASSIGNMENT.replace("size=64,offset=0)", "size=8,offset=0)"))
    assert bench.residual_stream_bytes(str(tmp_path), "jit_local_step", {"f32[2,2,4]"}) == 128 + 64


def test_a_module_with_no_dump_is_an_error(bench, tmp_path):
    with pytest.raises(FileNotFoundError, match="no buffer assignment of jit_step"):
        bench.residual_stream_bytes(str(tmp_path), "jit_step", {"f32[2,2,4]"})
