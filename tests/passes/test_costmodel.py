"""The communication cost model: alpha-beta formulas, presets, predictions of real steps, calibration.

Expected times are written out by hand from the formulas in
``replicator/cost/collectives.py`` (numbers chosen so that each term is easy to
check), never computed with the module's own helpers.
"""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.core.graph import CollectiveRecord
from replicator.cost.collectives import collective_time
from replicator.cost.topology import PRESETS, Link, Topology, get_topology
from replicator.tools.calibrate import calibrate, fit_link

#: Distinct links, so that a test sees which one was used: cores 1 us + 1 ns/B, workers 10 us + 10 ns/B.
TOPO = Topology("test", cores=Link(1e-6, 1e-9), workers=Link(1e-5, 1e-8), source="tests")


def _record(kind, n, nbytes, group=None, algorithm="native"):
    return CollectiveRecord(kind, group, algorithm, "float32", nbytes, 1, ("here",), "step", 0.0, 0, n)


@pytest.mark.parametrize(
    ("kind", "group", "algorithm", "n", "nbytes", "num_workers", "want"),
    [
        # ring all-reduce: 2 (N-1) alpha + 2 (N-1)/N B beta
        ("all_sum", "cores", "ring", 8, 8000, 2, 14 * 1e-6 + 14 / 8 * 8000 * 1e-9),  # 14 us + 14 us
        ("all_mean", "workers", "ring", 4, 4000, 4, 6 * 1e-5 + 6 / 4 * 4000 * 1e-8),  # 60 us + 60 us
        # native is costed as the ring
        ("all_sum", "cores", "native", 8, 8000, 2, 2.8e-5),
        ("all_max", "cores", "native", 2, 1000, 1, 2 * 1e-6 + 1 * 1000 * 1e-9),  # 3 us
        # all replicas: the workers link with 2 workers, the cores link with one
        ("all_sum", None, "native", 8, 8000, 2, 14 * 1e-5 + 14 / 8 * 8000 * 1e-8),  # 140 us + 140 us
        ("all_sum", None, "native", 8, 8000, 1, 2.8e-5),
        ("all_sum", None, "native", 8, 8000, None, 2.8e-4),  # unknown: the slower link
        # tree: 2 ceil(log2 N) (alpha + B beta)
        ("all_sum", "cores", "reduce_broadcast", 8, 8000, 1, 6 * (1e-6 + 8e-6)),  # 54 us
        ("all_sum", "cores", "reduce_broadcast", 5, 8000, 1, 6 * 9e-6),  # ceil(log2 5) = 3
        ("all_sum", "cores", "reduce_broadcast", 4, 8000, 1, 4 * 9e-6),
        ("all_sum", "workers", "reduce_broadcast", 2, 1000, 2, 2 * (1e-5 + 1e-5)),  # 40 us
        # all_gather: (N-1) alpha + (N-1) B beta, B one replica's input
        ("all_gather", "cores", "native", 4, 1000, 2, 3 * 1e-6 + 3 * 1000 * 1e-9),  # 6 us
        ("all_gather", None, "native", 8, 1000, 2, 7 * 1e-5 + 7 * 1000 * 1e-8),  # 140 us
        # reduce_scatter: (N-1) alpha + (N-1)/N B beta
        ("reduce_scatter", "workers", "native", 4, 4000, 4, 3 * 1e-5 + 3 / 4 * 4000 * 1e-8),  # 60 us
        ("reduce_scatter", "cores", "native", 4, 4000, 2, 3e-6 + 3e-6),
        # broadcast: a masked all-reduce
        ("broadcast", "cores", "native", 8, 800, 1, 14e-6 + 14 / 8 * 800e-9),  # 15.4 us
        # nothing sent
        ("replica_id", None, "native", 8, 0, 2, 0.0),
        ("all_sum", "cores", "ring", 1, 8000, 1, 0.0),
        ("all_gather", "workers", "native", 1, 8000, 1, 0.0),
    ],
)
def test_formulas_match_hand_computed_times(kind, group, algorithm, n, nbytes, num_workers, want):
    got = collective_time(_record(kind, n, nbytes, group, algorithm), TOPO, num_workers=num_workers)
    assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-18), (got, want)


def test_unknown_algorithm_and_kind_raise():
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        collective_time(_record("all_sum", 4, 100, "cores", "butterfly"), TOPO)
    with pytest.raises(ValueError, match="no cost formula"):
        collective_time(_record("all_to_all", 4, 100, "cores"), TOPO)


def test_unknown_preset_lists_the_presets(n_devices):
    report = rp.Replicator(1, n_devices).explain(lambda b: rp.all_sum(b), np.ones((n_devices, 4), np.float32))
    with pytest.raises(ValueError, match="unknown topology 'h100'.*'gpu-nvlink-8'.*calibrate") as err:
        report.predict("h100")
    for name in PRESETS:
        assert repr(name) in str(err.value)
    with pytest.raises(TypeError, match="Topology or a preset name"):
        get_topology(42)


def test_links_reject_negative_or_infinite_figures():
    with pytest.raises(ValueError, match="alpha_s must be a finite number >= 0"):
        Link(-1e-6, 1e-9)
    with pytest.raises(ValueError, match="beta_s_per_byte"):
        Link(1e-6, math.inf)
    assert math.isclose(Link.from_bandwidth(2e-6, 12.5e9).beta_s_per_byte, 8e-11)


def test_presets_have_sources_and_sane_links():
    assert set(PRESETS) == {"cpu-emulated", "gpu-nvlink-8", "gpu-hosts-100gbe", "tpu-v3-pod"}
    for name, topo in PRESETS.items():
        assert topo.name == name and topo.source
        for link in (topo.cores, topo.workers):
            assert 0 < link.alpha_s < 1e-3 and 0 < link.beta_s_per_byte < 1e-6
    # Ethernet between hosts is slower than NVLink inside one
    hosts = PRESETS["gpu-hosts-100gbe"]
    assert hosts.cores == PRESETS["gpu-nvlink-8"].cores
    assert hosts.workers.beta_s_per_byte > 10 * hosts.cores.beta_s_per_byte


def _two_level(n_devices):
    if n_devices < 8 or n_devices % 2:
        pytest.skip("needs an even number of at least 8 devices")
    return 2, n_devices // 2


def test_hierarchical_rows_are_costed_on_their_own_links(n_devices):
    w, c = _two_level(n_devices)
    x = np.ones((c, 1000), np.float32)  # one worker's batch: a row of 1000 floats per replica
    step = lambda b: rp.all_sum(b[0])  # noqa: E731
    flat = rp.Replicator(w, c).explain(step, x)
    hier = rp.Replicator(w, c, passes=rp.PassManager.default(hierarchical=True)).explain(step, x)
    assert [(r.kind, r.group) for r in hier.rows] == [
        ("reduce_scatter", "cores"),
        ("all_sum", "workers"),
        ("all_gather", "cores"),
    ]
    b = 4000
    chunk = b // c  # 1000 divides by the core counts used here (4 on 8 devices)
    assert [r.nbytes for r in hier.rows] == [b, chunk, chunk]
    want = [
        (c - 1) * 1e-6 + (c - 1) / c * b * 1e-9,  # reduce-scatter over cores
        2 * (w - 1) * 1e-5 + 2 * (w - 1) / w * chunk * 1e-8,  # all-reduce of a chunk over workers
        (c - 1) * 1e-6 + (c - 1) * chunk * 1e-9,  # all-gather over cores
    ]
    pred = hier.predict(TOPO)
    assert np.allclose(pred.seconds, want, rtol=1e-12)
    assert math.isclose(pred.total_s, sum(want), rel_tol=1e-12)
    n = w * c  # without the pass: one ring over all replicas, paced by the workers link
    (flat_row,) = flat.rows
    assert math.isclose(flat.predict(TOPO).total_s, 2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * b * 1e-8, rel_tol=1e-12)
    assert pred.total_s < flat.predict(TOPO).total_s


def _params(width=16):
    return {"w": jnp.ones((width, width)), "b": jnp.ones(width)}


def _step(p, batch):
    def loss_fn(p):
        return jnp.mean(jnp.tanh(batch["x"] @ p["w"] + p["b"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(p)
    g = rp.all_mean(g)
    feats = rp.all_gather(batch["x"][:, :2], tiled=True)
    local = rp.all_max(jnp.max(batch["x"]), group="cores")
    new = jax.tree.map(lambda a, d: a - 0.1 * d, p, g)
    return new, {"loss": rp.all_mean(loss), "f": feats.sum(), "m": local}


def test_prediction_of_a_lowered_step_is_the_sum_of_hand_formulas(n_devices):
    w, c = _two_level(n_devices)
    n = w * c
    batch = {"x": np.ones((2 * c, 16), np.float32)}  # 2 rows per replica
    report = rp.Replicator(w, c).explain(_step, batch, _params())
    before = str(report)
    pred = report.predict("gpu-hosts-100gbe")
    rows = {(r.kind, r.group): r for r in report.rows}
    assert set(rows) == {("all_mean", None), ("all_gather", None), ("all_max", "cores")}
    grads = (16 * 16 + 16 + 1) * 4  # the fused bucket: w, b and the loss
    assert rows["all_mean", None].nbytes == grads
    alpha_eth, bw_eth = 9.6e-6, 12.5e9  # between hosts (two workers: every all-replica collective)
    alpha_nvl, bw_nvl = 3.4e-6, 450e9  # inside a host
    want = {
        ("all_mean", None): 2 * (n - 1) * alpha_eth + 2 * (n - 1) / n * grads / bw_eth,
        ("all_gather", None): (n - 1) * alpha_eth + (n - 1) * (2 * 2 * 4) / bw_eth,
        ("all_max", "cores"): 2 * (c - 1) * alpha_nvl + 2 * (c - 1) / c * 4 / bw_nvl,
    }
    got = {(r.kind, r.group): t for r, t in zip(pred.rows, pred.seconds, strict=True)}
    for key, t in want.items():
        assert math.isclose(got[key], t, rel_tol=1e-9), (key, got[key], t)
    assert math.isclose(pred.total_s, sum(want.values()), rel_tol=1e-9)
    text = str(pred)
    assert "all_mean" in text and "gpu-hosts-100gbe" in text and "predicted communication per step" in text
    # the same step on NVLink only is faster, and the report itself is unchanged by predicting
    assert report.predict("gpu-nvlink-8").total_s < pred.total_s
    assert str(report) == before and "predicted communication" not in before


def test_calibrate_measures_both_axes_quickly_and_fits_its_own_measurements(n_devices):
    w, c = _two_level(n_devices)
    t0 = time.perf_counter()
    topo = calibrate(w, c, sizes=(1024, 64 * 1024, 512 * 1024), repeats=5, chain=4, time_budget_s=20)
    elapsed = time.perf_counter() - t0
    assert elapsed < 90, f"calibrate took {elapsed:.0f} s"
    for link in (topo.cores, topo.workers):
        assert math.isfinite(link.alpha_s) and link.alpha_s >= 0
        assert math.isfinite(link.beta_s_per_byte) and link.beta_s_per_byte >= 0
        assert link.alpha_s > 0 or link.beta_s_per_byte > 0
    assert {(m.axis, m.group_size) for m in topo.measurements} == {("cores", c), ("workers", w)}
    assert topo.name == f"calibrated {w}x{c}" and "calibrate" in topo.source
    # The fitted formula (on CPU devices one latency per psum) reproduces the measurements within a
    # factor of 4: all of them but at most one per axis (two parameters fitted to three sizes timed
    # on a loaded 2-core machine: one noisy point may pull the fit away from another).
    for axis in ("cores", "workers"):
        link = topo.cores if axis == "cores" else topo.workers
        off = []
        for m in (m for m in topo.measurements if m.axis == axis):
            model = link.alpha_s + 2 * (m.group_size - 1) / m.group_size * m.nbytes * link.beta_s_per_byte
            if not m.seconds / 4 <= model <= 4 * m.seconds:
                off.append((m, model))
        assert len(off) <= 1, off
    # the bigger payload takes longer on each axis
    for axis in ("cores", "workers"):
        times = [m.seconds for m in sorted(topo.measurements, key=lambda m: m.nbytes) if m.axis == axis]
        assert times[-1] > times[0]
    # ppermute messages are measured too, into the p2p links of the ring and tree algorithms
    for link in (topo.p2p_cores, topo.p2p_workers):
        assert link is not None and link.alpha_s >= 0 and link.beta_s_per_byte >= 0
    assert topo.native_latency == "one"  # CPU devices: one in-memory reduction per psum


def test_ring_and_tree_are_costed_on_the_point_to_point_links():
    p2p = Link(1e-4, 1e-9)  # messages cost 100 us, the native collective's steps 1 us
    topo = Topology("p2p", cores=Link(1e-6, 1e-9), workers=Link(1e-5, 1e-8), source="tests", p2p_cores=p2p)
    ring = collective_time(_record("all_sum", 8, 8000, "cores", "ring"), topo)
    tree = collective_time(_record("all_sum", 8, 8000, "cores", "reduce_broadcast"), topo)
    native = collective_time(_record("all_sum", 8, 8000, "cores", "native"), topo)
    assert ring == pytest.approx(14 * 1e-4 + 14 / 8 * 8000 * 1e-9)
    assert tree == pytest.approx(6 * (1e-4 + 8000 * 1e-9))
    assert native == pytest.approx(14 * 1e-6 + 14 / 8 * 8000 * 1e-9)
    # workers have no p2p link of their own: the collective link
    assert collective_time(_record("all_sum", 2, 100, "workers", "ring"), topo) == pytest.approx(2 * 1e-5 + 100 * 1e-8)


def test_one_latency_per_native_collective_on_shared_memory_devices():
    flat = Topology("cpu", cores=Link(1e-4, 1e-9), workers=Link(1e-4, 1e-9), source="tests", native_latency="one")
    assert collective_time(_record("all_sum", 8, 8000), flat, num_workers=1) == pytest.approx(1e-4 + 14 / 8 * 8e-6)
    assert collective_time(_record("all_gather", 8, 800), flat, num_workers=1) == pytest.approx(1e-4 + 7 * 8e-7)
    assert collective_time(_record("reduce_scatter", 8, 800), flat, num_workers=1) == pytest.approx(1e-4 + 7 / 8 * 8e-7)
    assert PRESETS["cpu-emulated"].native_latency == "one" and PRESETS["gpu-nvlink-8"].native_latency == "ring"


def test_an_unfused_all_sum_of_several_arrays_pays_latency_per_operand(n_devices):
    repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(disable=["fuse-collectives"]))
    report = repl.explain(lambda b: rp.all_sum([b * i for i in range(5)]), np.ones((n_devices, 4), np.float32))
    (row,) = report.rows
    assert row.operands == 5
    n = n_devices
    alpha, beta = TOPO.cores.alpha_s, TOPO.cores.beta_s_per_byte
    want = 5 * 2 * (n - 1) * alpha + 2 * (n - 1) / n * row.nbytes * beta
    assert collective_time(row, TOPO, num_workers=1) == pytest.approx(want)


def test_calibrate_rejects_a_single_size():
    with pytest.raises(ValueError, match="at least 2 different byte counts"):
        calibrate(1, 2, sizes=(1024, 1024))


def test_fit_link_recovers_known_figures_and_stays_non_negative():
    alpha, beta = 5e-6, 2e-9
    points = [(n, b, 2 * (n - 1) * alpha + 2 * (n - 1) / n * b * beta) for n in (2, 8) for b in (1e3, 1e5, 1e7)]
    link = fit_link(points)
    assert math.isclose(link.alpha_s, alpha, rel_tol=1e-6) and math.isclose(link.beta_s_per_byte, beta, rel_tol=1e-6)
    # time falling with size would need a negative beta: clipped to 0, alpha refitted alone
    link = fit_link([(4, 1e3, 2e-5), (4, 1e6, 1e-5)])
    assert link.beta_s_per_byte == 0 and link.alpha_s > 0
