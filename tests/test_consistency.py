"""Replicator(check_state_every=K): replicas whose state drifted apart are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.runtime.consistency import check_copies_agree, check_replicas_agree


def _input(n):
    return lambda ctx: iter([{"x": np.ones((n, 2), np.float32)}] * 100)


def _differs_on(repl, device_id):
    """A 'replicated' array placed by hand with a different value on one device."""
    parts = [jax.device_put(np.full(2, float(d.id == device_id), np.float32), d) for d in repl.mesh.devices.flat]
    return jax.make_array_from_single_device_arrays((2,), NamedSharding(repl.mesh, P()), parts)


def test_identical_replicas_pass_every_step(n_devices):
    repl = rp.Replicator(1, n_devices, check_state_every=1)
    state = {"w": jnp.zeros(2), "n": jnp.int32(0), "flag": jnp.bool_(True), "h": jnp.zeros(3, jnp.bfloat16)}

    def step(s, b):
        return {**s, "w": s["w"] + rp.all_mean(b["x"][0]), "n": s["n"] + 1}, {}

    input_fn = _input(n_devices)
    for _ in range(3):
        state, _ = repl.run(step, input_fn, state)
    assert int(state["n"]) == 3


def test_a_drifted_leaf_is_named_with_the_devices(n_devices):
    repl = rp.Replicator(1, n_devices, check_state_every=2)
    device = repl.mesh.devices.flat[n_devices - 1].id
    state = {"ok": jnp.ones(3), "w": _differs_on(repl, device)}

    def step(s, b):
        return {"ok": s["ok"], "w": s["w"] * 1.0}, {}

    state, _ = repl.run(step, _input(n_devices), state)  # step 1: not checked (K = 2)
    with pytest.raises(rp.DivergentStateError, match=rf"state\['w'\] is no longer identical.*\[{device}\] another"):
        repl.run(step, _input(n_devices), state)


def test_the_checksum_sees_a_one_ulp_change_and_a_swap(n_devices):
    repl = rp.Replicator(1, n_devices)
    sharding = NamedSharding(repl.mesh, P())
    base = np.arange(6, dtype=np.float32)
    for other in (np.nextafter(base, 10).astype(np.float32), base[[1, 0, 2, 3, 4, 5]]):
        parts = [jax.device_put(other if i == 1 else base, d) for i, d in enumerate(repl.mesh.devices.flat)]
        leaf = jax.make_array_from_single_device_arrays((6,), sharding, parts)
        with pytest.raises(rp.DivergentStateError):
            check_replicas_agree([leaf], ["state['x']"])


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match="check_state_every must be a positive int"):
        rp.Replicator(1, 1, check_state_every=0)


def _stage_rows(values_per_device, mesh):
    """A (stages, 3) array laid out P('stages') on ``mesh``: each device's shard given by hand."""
    sharding = NamedSharding(mesh, P("stages"))
    index = sharding.devices_indices_map((mesh.shape["stages"], 3))
    parts = [jax.device_put(values_per_device(d, index[d][0].start), d) for d in mesh.devices.flat]
    return jax.make_array_from_single_device_arrays((mesh.shape["stages"], 3), sharding, parts)


def test_copies_of_a_stage_row_are_compared_within_the_stage():
    from jax.sharding import Mesh

    from replicator.runtime.consistency import check_copies_agree

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("stages", "cores"))
    # Each stage holds its own row (they differ by design); its 4 replicas hold the same copy.
    same = _stage_rows(lambda d, stage: np.full((1, 3), stage, np.float32), mesh)
    check_copies_agree([same], ["rows['float32']"])
    odd = mesh.devices[1, 2].id  # one replica of stage 1 drifted by one ulp
    drifted = _stage_rows(
        lambda d, stage: np.full((1, 3), np.nextafter(np.float32(1), 2) if d.id == odd else stage, np.float32), mesh
    )
    with pytest.raises(
        rp.DivergentStateError, match=rf"rows\['float32'\]: the copies of its part \[1:2, :\].*\[{odd}\] another"
    ):
        check_copies_agree([drifted], ["rows['float32']"])


def _drift(rows, device_id):
    """``rows`` (a tree of arrays on a mesh) with one device's shards moved by 1."""

    def one(leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        parts = [s.data + 1 if s.device.id == device_id else s.data for s in leaf.addressable_shards]
        return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, parts)

    return jax.tree.map(one, rows)


@pytest.mark.parametrize("entry", ["run", "run_pipelined"])
def test_a_pipeline_stage_whose_replica_drifted_is_named(entry):
    import optax

    from tests.stages.test_gpipe import four_stages_tied
    from tests.stages.test_replicas import _params_for, global_batch
    from tests.stages.test_user_step import make_step

    p, batch = _params_for(four_stages_tied), global_batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(
        1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=4), check_state_every=1
    )
    step = make_step(four_stages_tied, opt)

    def run(state):
        if entry == "run":
            return repl.run(step, batch, state)[0]
        return repl.run_pipelined(four_stages_tied, opt, batch, state)[0]

    state = run(run((p, opt.init(p))))  # two steps, checked: the replicas agree
    # A device of stage 2 drifts (as a faulty device would): the next step starts from its rows.
    built = repl.pipelined.user_step(step, batch, state) if entry == "run" else None
    last = (
        built._last
        if built is not None
        else repl.pipelined.step_for(four_stages_tied, opt).built(*(state[0],), *batch)._last
    )
    odd = repl.pipelined.mesh.devices[2].flat[1].id
    last._rows = _drift(last.rows, odd)
    with pytest.raises(rp.DivergentStateError, match=rf"the packed state.*\[{odd}\] another"):
        run(state)


def _replicated_with(repl, base, other, on_index=1):
    """``base`` on every device of ``repl``'s mesh but one, which holds ``other``."""
    sharding = NamedSharding(repl.mesh, P())
    parts = [jax.device_put(other if i == on_index else base, d) for i, d in enumerate(repl.mesh.devices.flat)]
    return jax.make_array_from_single_device_arrays(np.shape(base), sharding, parts)


def test_a_sign_flip_and_narrow_dtypes_are_seen(n_devices):
    # A sign flip moves only the top bit of one element: the checksum keeps it. bfloat16 and bool leaves are
    # checked too (2 and 1 bytes per element).
    repl = rp.Replicator(1, n_devices)
    cases = [
        (np.array([1.0, 0.0], np.float32), np.array([-1.0, 0.0], np.float32)),
        (jnp.array([1.0, 2.0], jnp.bfloat16), jnp.array([1.0, 2.5], jnp.bfloat16)),
        (np.array([True, False]), np.array([True, True])),
    ]
    for base, other in cases:
        with pytest.raises(rp.DivergentStateError):
            check_replicas_agree([_replicated_with(repl, base, other)], ["state['x']"])
        rows = _replicated_with(repl, base[None], other[None])  # one part, every device a copy of it
        with pytest.raises(rp.DivergentStateError):
            check_copies_agree([rows], ["rows['x']"])


def test_a_sharded_leaf_is_not_a_replicated_one(n_devices):
    # ZeRO's chunks differ between devices by design: check_replicas_agree skips them, check_copies_agree
    # compares only devices holding the same chunk (none here).
    repl = rp.Replicator(1, n_devices)
    sharding = NamedSharding(repl.mesh, P(("workers", "cores")))
    parts = [jax.device_put(np.full(1, float(i), np.float32), d) for i, d in enumerate(repl.mesh.devices.flat)]
    chunks = jax.make_array_from_single_device_arrays((n_devices,), sharding, parts)
    check_replicas_agree([chunks], ["state['chunked']"])
    check_copies_agree([chunks], ["state['chunked']"])


@pytest.mark.parametrize(
    "values",
    [
        np.linspace(-3, 3, 37, dtype=np.float32),
        np.arange(-20, 20, 3, dtype=np.int8),
        np.array([[1.5, -2.0], [0.25, 7.0]], jnp.bfloat16),
        np.array([True, False, True, True]),
    ],
    ids=["float32", "int8", "bfloat16", "bool"],
)
def test_the_checksum_is_the_documented_sum(values):
    # An independent NumPy reference: each element's bits times (1 + i * 2654435761), summed modulo 2**32,
    # then xor the element count; 4 bytes, exact (wrapping integer arithmetic, no rounding).
    from replicator.runtime.consistency import _checksum

    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[values.dtype.itemsize]
    bits = values.reshape(-1).view(unsigned).astype(np.uint64)
    weights = (np.arange(bits.size, dtype=np.uint64) * 2654435761 + 1) % 2**32
    want = (int(np.sum(bits * weights % 2**32)) % 2**32) ^ bits.size
    got = _checksum(jnp.asarray(values))
    assert got.dtype == jnp.uint32 and int(got) == want


def test_the_majority_is_named_first_and_skipped_leaves_stop_nothing(n_devices):
    import re

    if n_devices < 3:
        pytest.skip("needs 3 devices: a majority and one drifted")
    repl = rp.Replicator(1, n_devices)
    drifted = repl.mesh.devices.flat[1].id
    others = {d.id for d in repl.mesh.devices.flat} - {drifted}
    leaf = _differs_on(repl, drifted)
    # A host array before the drifted leaf is skipped (not a device array), and the check goes on past it.
    for check, rows in ((check_replicas_agree, leaf), (check_copies_agree, leaf[None])):
        with pytest.raises(rp.DivergentStateError) as caught:
            check([np.ones(2, np.float32), rows], ["host['h']", "state['w']"])
        found = re.search(
            r"state\['w'\].*devices \[([\d, ]+)\] hold one value, \[([\d, ]+)\] another", str(caught.value)
        )
        assert found, caught.value
        assert {int(d) for d in found[1].split(", ")} == others and found[2] == str(drifted)


def _copies_job(*args: str):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--cores-per-worker", "2"]
    worker = root / "tests" / "multiproc" / "copies_worker.py"
    return subprocess.run(
        [*command, str(worker), *args], env=env, cwd=root, capture_output=True, text=True, timeout=180
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("drift", [False, True], ids=["same", "one-copy-drifted"])
def test_copies_on_two_processes_are_compared(drift):
    # Each stage's two copies sit on two processes: before, each process compared only its own devices (one
    # copy each) and a drifted copy passed. Both workers now see it, with the devices of the other process.
    proc = _copies_job(*(["--drift"] if drift else []))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    if not drift:
        assert proc.stdout.count("the copies agree") == 2, out[-3000:]
        return
    said = [
        next((x.split(f"worker {w}: ", 1)[1] for x in proc.stdout.splitlines() if f"worker {w}: " in x), "")
        for w in (0, 1)
    ]
    assert said[0] == said[1], said  # both workers name the same devices
    assert "rows['float32']: the copies of its part [0:1, :] are no longer identical: devices [" in said[0], out[-3000:]


def test_a_leaf_on_another_mesh_is_compared_on_its_own_devices():
    # The gathered check takes the first leaf's mesh; a leaf placed on another mesh (other devices) is still
    # checked, on this process's devices, and its drift is named.
    from jax.sharding import Mesh

    devices = jax.devices()[:8]
    first = Mesh(np.array(devices[:4]).reshape(2, 2), ("stages", "cores"))
    other = Mesh(np.array(devices[4:]).reshape(2, 2), ("stages", "cores"))
    agree = _stage_rows(lambda d, stage: np.full((1, 3), stage, np.float32), first)
    odd = other.devices[0, 1].id
    drifted = _stage_rows(lambda d, stage: np.full((1, 3), 9.0 if d.id == odd else stage, np.float32), other)
    check_copies_agree([agree, _stage_rows(lambda d, stage: np.full((1, 3), stage, np.float32), other)], ["a", "b"])
    with pytest.raises(rp.DivergentStateError, match=rf"b: the copies of its part \[0:1, :\].*\[{odd}\] another"):
        check_copies_agree([agree, drifted], ["a", "b"])


@pytest.mark.parametrize(
    ("base", "other"),
    [
        (np.float32(1024.0), np.float32(2048.0)),  # a loss scale
        (np.int32(7), np.int32(8)),  # a step count
        (np.bool_(True), np.bool_(False)),  # a flag
        (np.float16(0.5), np.float16(0.25)),  # a narrow scalar
    ],
    ids=["loss-scale", "step-count", "flag", "float16"],
)
def test_a_0d_leaf_that_drifted_is_named_by_both_checks(n_devices, base, other):
    """0-d leaves (a loss scale, a step count) are state too: one device's copy off is named, by the replicas'
    check and by the copies' check, and an undrifted one passes both."""
    repl = rp.Replicator(1, n_devices)
    drifted = _replicated_with(repl, base, other)
    assert drifted.shape == () and drifted.sharding.is_fully_replicated
    with pytest.raises(rp.DivergentStateError, match=r"state\['scale'\]"):
        check_replicas_agree([jnp.ones(2), drifted], ["state['w']", "state['scale']"])
    with pytest.raises(rp.DivergentStateError, match=r"state\['scale'\]"):
        check_copies_agree([jnp.ones(2), drifted], ["state['w']", "state['scale']"])
    same = _replicated_with(repl, base, base)
    check_replicas_agree([same], ["state['scale']"])
    check_copies_agree([same], ["state['scale']"])


def test_a_0d_leaf_drifted_by_hand_stops_a_checked_run(n_devices):
    repl = rp.Replicator(1, n_devices, check_state_every=1)
    state = {"w": jnp.zeros(2), "step": _replicated_with(repl, np.int32(3), np.int32(4))}

    def step(s, b):
        return {"w": s["w"] + rp.all_mean(b["x"][0]), "step": s["step"] + 1}, {}

    with pytest.raises(rp.DivergentStateError, match=r"state\['step'\] is no longer identical"):
        repl.run(step, _input(n_devices), state)


def test_an_8_byte_leaf_is_skipped_and_the_leaves_after_it_are_still_checked(n_devices):
    """complex64 (8 bytes an element) has no 32-bit checksum here: it is left out, not an error, and a drifted
    float32 leaf after it is still named by both checks."""
    repl = rp.Replicator(1, n_devices)
    wide = _replicated_with(repl, np.array([1 + 1j], np.complex64), np.array([2 + 1j], np.complex64))
    same = _replicated_with(repl, np.ones(2, np.float32), np.ones(2, np.float32))
    drifted = _replicated_with(repl, np.ones(2, np.float32), np.zeros(2, np.float32))
    check_replicas_agree([wide, same], ["state['c']", "state['w']"])
    check_copies_agree([wide, same], ["state['c']", "state['w']"])
    with pytest.raises(rp.DivergentStateError, match=r"state\['w'\]"):
        check_replicas_agree([wide, drifted], ["state['c']", "state['w']"])
    with pytest.raises(rp.DivergentStateError, match=r"state\['w'\]"):
        check_copies_agree([wide, drifted], ["state['c']", "state['w']"])


@pytest.mark.parametrize("other_worker_agrees", [True, False])
def test_each_process_is_compared_with_worker_0s_copy(n_devices, monkeypatch, other_worker_agrees):
    """As process 0 of two (faked): this process's devices agree with each other; worker 1's checksum, from
    the one all-gather of every process's, is compared with it and named when it differs."""
    from jax.experimental import multihost_utils

    repl = rp.Replicator(1, n_devices)
    leaves = [_replicated_with(repl, np.arange(3, dtype=np.float32), np.arange(3, dtype=np.float32))]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    gathered = []

    def allgather(local):
        gathered.append(local)
        return np.stack([local, local if other_worker_agrees else local ^ 1])

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    if other_worker_agrees:
        check_replicas_agree(leaves, ["state['w']"])
    else:
        with pytest.raises(ValueError, match=r"the replicated state differs between workers: state\['w'\] on worker"):
            check_replicas_agree(leaves, ["state['w']"])
    assert len(gathered) == 1
