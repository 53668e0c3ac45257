"""What a compiled step holds on each device, from XLA's compiled memory analysis.

``Replicator.lower(step_fn, batch, state).memory()`` compiles the step (as its
first run would) and reads XLA's own accounting of one device's program: the
bytes of its arguments (state and batch), of its outputs, of the outputs that
reuse an argument's buffer (donated state), and of its temporaries. The peak is
``arguments + outputs - aliased + temporaries``: everything the step needs live
at once on one device, as XLA planned it.

>>> repl = rp.Replicator(1, 8)
>>> step = lambda w, b: (w - rp.all_mean(b["x"]).sum(0), {})
>>> usage = repl.lower(step, {"x": np.ones((8, 1024), np.float32)}, np.zeros(1024, np.float32)).memory()
>>> usage.arguments >= 4096 + 4096  # the replicated state and one replica's rows, per device
True
>>> usage.peak == usage.arguments + usage.outputs - usage.aliased + usage.temporaries
True

Promises:

1. ``peak == arguments + outputs - aliased + temporaries``, every figure XLA's own
   (tests/test_memory.py::test_xla_counts_the_arguments_the_graph_says_a_device_holds).
2. ``arguments`` is what the graph says one device holds (the state, ZeRO-sharded leaves 1/N of it), one
   replica's batch rows and the runtime constants, with or without ZeRO
   (tests/test_memory.py::test_xla_counts_the_arguments_the_graph_says_a_device_holds); ZeRO makes the state
   and the peak smaller (tests/test_memory.py::test_zero_divides_the_state_and_the_peak).
3. A state leaf kept per replica counts one row per device, not all of them, and a narrow leaf (bfloat16) its
   own bytes per element
   (tests/test_memory.py::test_a_per_replica_leaf_counts_one_row_per_device_and_a_bfloat16_one_two_bytes_an_element).
4. Donated state (``donate_state=True``) is counted as ``aliased``: the new state's bytes; without donation
   ``aliased`` is 0 (tests/test_memory.py::test_donated_state_is_counted_as_aliased).
5. ``str(usage)`` says the peak and its four terms in MiB, and ``explain`` prints it next to the state the
   graph predicts (tests/test_memory.py::test_explain_prints_the_predicted_state_and_the_measured_memory).
6. A ``Lowered`` that does not know its devices is a ``ValueError`` that says so, not a guess
   (tests/test_memory.py::test_a_lowered_that_does_not_know_its_devices_says_so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import Mesh, NamedSharding

from replicator.core.graph import StepGraph
from replicator.runtime.execution import sharded, state_spec

__all__ = ["MemoryUsage", "compiled_memory"]


@dataclasses.dataclass(frozen=True)
class MemoryUsage:
    """Bytes per device of one compiled step (XLA's ``memory_analysis()`` of its program)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def peak(self) -> int:
        """``arguments + outputs - aliased + temporaries``: what the step needs live at once."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def __str__(self) -> str:
        mib = 2.0**20
        return (
            f"per-device memory (XLA's compiled memory analysis): peak {self.peak / mib:.2f} MiB = arguments "
            f"{self.arguments / mib:.2f} + outputs {self.outputs / mib:.2f} - aliased {self.aliased / mib:.2f} "
            f"+ temporaries {self.temporaries / mib:.2f} MiB"
        )


def compiled_memory(executable: Callable, traced: StepGraph, final: StepGraph, mesh: Mesh) -> MemoryUsage:
    """Compile ``executable`` (from :func:`~replicator.runtime.execution.build_executable`) and read its memory.

    Args:
      executable: the jitted step over ``mesh``.
      traced: the step as traced (its avals: whole state leaves, one replica's batch rows).
      final: the graph that runs (which state leaves it stores sharded).
      mesh: the device mesh.
    """
    n_state = traced.num_state
    avals = [v.aval for v in traced.jaxpr.jaxpr.invars]
    replicas = traced.context.num_replicas
    state = [
        jax.ShapeDtypeStruct(
            (replicas * a.shape[0], *a.shape[1:]) if i in traced.per_replica_state else a.shape,  # one row each
            a.dtype,
            sharding=NamedSharding(mesh, state_spec(i, final.sharded_state, final.tensor)),
        )
        for i, a in enumerate(avals[:n_state])
    ]
    batch = [
        jax.ShapeDtypeStruct((replicas * a.shape[0], *a.shape[1:]), a.dtype, sharding=sharded(mesh))
        for a in avals[n_state:]
    ]
    stats = executable.lower(state, batch).compile().memory_analysis()  # XLA's CompiledMemoryStats
    return MemoryUsage(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
    )
