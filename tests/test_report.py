"""Replicator.explain: the communication report of a step."""

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp


def _params(layers=4, width=8):
    return {f"w{i}": jnp.ones((width, width)) for i in range(layers)} | {
        f"b{i}": jnp.ones(width) for i in range(layers)
    }


def _loss(p, x):
    for i in range(len(p) // 2):
        x = jnp.tanh(x @ p[f"w{i}"] + p[f"b{i}"])
    return jnp.mean(x**2)


def _step(p, b):
    loss, g = jax.value_and_grad(_loss)(p, b["x"])
    g = rp.all_mean(g)
    feats = rp.all_gather(b["x"][:, :2], tiled=True)
    return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), {"loss": rp.all_mean(loss), "f": feats.sum()}


def _batch(n, width=8):
    return {"x": np.ones((2 * n, width), np.float32)}


def test_fused_gradients_are_one_row_carrying_every_tensor(n_devices):
    n = n_devices
    repl = rp.Replicator(1, n, passes=rp.PassManager.default(shard_optimizer=False))
    report = repl.explain(_step, _batch(n), _params())
    kinds = [r.kind for r in report.rows]
    assert kinds == ["all_mean", "all_gather"]
    grads = report.rows[0]
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(_params()))
    assert grads.tensors == len(_params()) + 1  # every gradient and the loss
    assert grads.nbytes == param_bytes + 4
    assert np.isclose(grads.sent_bytes, 2 * (n - 1) / n * grads.nbytes)
    gather = report.rows[1]
    assert gather.nbytes == 2 * 2 * 4 and np.isclose(gather.sent_bytes, (n - 1) * gather.nbytes)
    assert np.isclose(report.total_sent_bytes, grads.sent_bytes + gather.sent_bytes)
    text = str(report)
    assert "all_mean" in text and "test_report.py" in text and f"on {n} replicas" in text


def test_zero_rows_reduce_scatter_gradients_and_gather_parameters(n_devices):
    n = n_devices
    # Plain SGD has no optimizer state to shard: ZeRO's update splitting alone (shard_state=False).
    passes = rp.passes.default_passes()
    passes.insert(2, rp.passes.ShardOptimizerUpdate(shard_state=False, min_tensor_bytes=0))
    zero = rp.PassManager(passes)
    report = rp.Replicator(1, n, passes=zero).explain(_step, _batch(n, width=n), _params(width=n))
    rows = {r.kind: r for r in report.rows if r.kind in ("reduce_scatter", "all_mean")}
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(_params(width=n)))
    scatter = rows["reduce_scatter"]
    assert scatter.nbytes == param_bytes and scatter.tensors == len(_params())
    assert np.isclose(scatter.sent_bytes, (n - 1) / n * param_bytes)
    gathers = [r for r in report.rows if r.kind == "all_gather" and r.tensors == len(_params())]
    assert len(gathers) == 1 and gathers[0].nbytes * n == param_bytes
    assert rows["all_mean"].nbytes == 4  # only the loss is still all-reduced


def test_without_fusion_each_user_collective_is_a_row(n_devices):
    repl = rp.Replicator(
        1, n_devices, passes=rp.PassManager.default(disable=["fuse-collectives"], shard_optimizer=False)
    )
    report = repl.explain(_step, _batch(n_devices), _params())
    assert [r.kind for r in report.rows] == ["all_mean", "all_gather", "all_mean"]
    assert report.rows[0].tensors == len(_params())
    assert "fuse-collectives" not in report.passes


def test_explain_draws_from_a_fresh_input_iterator(repl):
    n = repl.num_replicas
    drawn = []

    def input_fn(ctx):
        for i in range(3):
            drawn.append(i)
            yield _batch(n)

    repl.explain(_step, input_fn, _params())
    assert drawn == [0]
    # run() still starts from the first batch of its own iterator.
    repl.run(_step, input_fn, _params())
    assert drawn == [0, 0]


def test_groups_use_their_own_size(repl2d):
    def step(b):
        return rp.all_sum(b["x"], group="cores"), rp.replica_id()

    report = repl2d.explain(step, _batch(repl2d.num_replicas))
    row = report.rows[0]
    c = repl2d.cores_per_worker
    assert row.group == "cores" and np.isclose(row.sent_bytes, 2 * (c - 1) / c * row.nbytes)
    assert report.rows[1].kind == "replica_id" and report.rows[1].sent_bytes == 0
    assert report.num_collectives == 1


# ----------------------------------------------------------------------------
# The report's bytes against the final jaxpr, counted independently
# ----------------------------------------------------------------------------

_REDUCTIONS = ("psum", "pmax", "pmin")
_COUNTED = (*_REDUCTIONS, "all_gather", "reduce_scatter", "ppermute")


def _count_final(lowered, axis_sizes):
    """``(operand bytes, estimated sent bytes per replica)`` of the mesh collectives of the final jaxpr.

    Walks every equation (sub-jaxprs too; a ``scan`` body counts ``length``
    times) and, for psum/pmax/pmin/all_gather/psum_scatter/ppermute, sums
    operand sizes times their dtype's itemsize.
    """
    total = 0
    sent = 0.0
    permuted: dict[int, float] = {}

    def walk(jaxpr, trips):
        nonlocal total, sent
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in _COUNTED:
                b = trips * sum(int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize for v in eqn.invars)
                total += b
                axes = eqn.params.get("axes", eqn.params.get("axis_name"))
                n = int(np.prod([axis_sizes[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
                if name in _REDUCTIONS:
                    sent += 2 * (n - 1) / n * b
                elif name == "all_gather":
                    sent += (n - 1) * b
                elif name == "reduce_scatter":
                    sent += (n - 1) / n * b
                else:
                    for src, _ in eqn.params["perm"]:
                        permuted[src] = permuted.get(src, 0.0) + b
            inner = trips * eqn.params["length"] if name == "scan" else trips
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple) else (value,):
                    if isinstance(item, jax.extend.core.ClosedJaxpr):
                        walk(item.jaxpr, inner)
                    elif isinstance(item, jax.extend.core.Jaxpr):
                        walk(item, inner)

    walk(lowered.final.jaxpr.jaxpr, 1)
    return total, sent + max(permuted.values(), default=0.0)


def _reduce_step(p, b):
    """Gradients all-reduced (one bucket when fused), nothing else."""
    g = jax.grad(_loss)(p, b["x"])
    return jax.tree.map(lambda a, d: a - 0.1 * d, p, rp.all_mean(g)), {}


def _report_and_count(repl, step, batch, state):
    report = repl.explain(step, batch, state)
    lowered = repl.lower(step, batch, state)
    axis_sizes = {"workers": repl.num_workers, "cores": repl.cores_per_worker}
    return report, _count_final(lowered, axis_sizes)


def _assert_matches(report, counted):
    total, sent = counted
    assert sum(r.emitted_bytes for r in report.rows) == total
    assert np.isclose(report.total_sent_bytes, sent)


def test_default_pipeline_bytes_match_the_final_jaxpr(n_devices):
    repl = rp.Replicator(1, n_devices)
    report, counted = _report_and_count(repl, _step, _batch(n_devices), _params())
    _assert_matches(report, counted)
    # Native lowering: what goes on the wire is the payload itself.
    assert counted[0] == sum(r.nbytes for r in report.rows)
    assert all(r.algorithm == "native" for r in report.rows)


def test_fused_bucket_is_one_row_with_every_tensor(n_devices):
    repl = rp.Replicator(1, n_devices)
    report, counted = _report_and_count(repl, _reduce_step, _batch(n_devices), _params())
    _assert_matches(report, counted)
    (row,) = report.rows
    assert row.kind == "all_mean" and row.tensors == len(_params())
    assert row.nbytes == sum(x.size * 4 for x in jax.tree.leaves(_params())) == counted[0]
    assert len(set(row.sources)) >= 1 and all("test_report.py" in s for s in row.sources)


def test_tensor_above_the_fusion_limit_keeps_its_own_row(n_devices):
    # w* are 8x8 f32 = 256 bytes, b* 32 bytes: with a 100-byte limit each w travels alone.
    pipe = rp.PassManager.default(fuse_max_tensor_bytes=100)
    repl = rp.Replicator(1, n_devices, passes=pipe)
    report, counted = _report_and_count(repl, _reduce_step, _batch(n_devices), _params())
    _assert_matches(report, counted)
    sizes = sorted((r.tensors, r.nbytes) for r in report.rows)
    assert sizes == [(1, 256)] * 4 + [(4, 4 * 32)]
    # A smaller bucket threshold splits the small tensors too.
    pipe = rp.PassManager.default(fuse_max_tensor_bytes=100, fuse_threshold_bytes=64)
    report, counted = _report_and_count(
        rp.Replicator(1, n_devices, passes=pipe), _reduce_step, _batch(n_devices), _params()
    )
    _assert_matches(report, counted)
    assert sorted((r.tensors, r.nbytes) for r in report.rows) == [(1, 256)] * 4 + [(2, 64)] * 2


def test_compressed_all_reduce_reports_bfloat16_bytes(n_devices):
    n = n_devices
    plain, plain_counted = _report_and_count(rp.Replicator(1, n), _reduce_step, _batch(n), _params())
    repl = rp.Replicator(1, n, passes=rp.PassManager.default(compress=True))
    report, counted = _report_and_count(repl, _reduce_step, _batch(n), _params())
    _assert_matches(report, counted)
    (row,) = report.rows
    assert row.dtype == "bfloat16" and row.kind == "all_sum"
    assert row.nbytes * 2 == plain.rows[0].nbytes
    assert counted[0] * 2 == plain_counted[0]
    assert np.isclose(row.sent_bytes, 2 * (n - 1) / n * row.nbytes)
    assert row.tensors == len(_params())


def test_ring_all_reduce_costs_its_chunks(n_devices):
    n = n_devices
    repl = rp.Replicator(1, n, passes=rp.PassManager.default(all_reduce_algorithm="ring"))
    report, counted = _report_and_count(repl, _reduce_step, _batch(n), _params())
    _assert_matches(report, counted)
    (row,) = report.rows
    assert row.algorithm == "ring"
    chunk = -(-row.nbytes // 4 // n) * 4  # f32 elements, padded to a multiple of n
    assert row.emitted_bytes == 2 * (n - 1) * chunk
    assert np.isclose(row.sent_bytes, 2 * (n - 1) * chunk)


def test_reduce_broadcast_is_not_costed_as_a_ring(n_devices):
    n = n_devices
    repl = rp.Replicator(1, n, passes=rp.PassManager.default(all_reduce_algorithm="reduce_broadcast"))
    report, counted = _report_and_count(repl, _reduce_step, _batch(n), _params())
    _assert_matches(report, counted)
    (row,) = report.rows
    assert row.algorithm == "reduce_broadcast"
    levels = int(np.ceil(np.log2(n)))
    # Every tree step moves the whole buffer; the busiest replica sends it once per level.
    assert row.emitted_bytes == 2 * levels * row.nbytes
    if n & (n - 1) == 0 and n > 1:
        assert np.isclose(row.sent_bytes, levels * row.nbytes)
        assert row.sent_bytes > 2 * (n - 1) / n * row.nbytes or n == 2


def test_hierarchical_rows_are_its_three_steps(repl2d):
    w, c = repl2d.num_workers, repl2d.cores_per_worker
    if w < 2 or c < 2:
        return
    repl = rp.Replicator(w, c, passes=rp.PassManager.default(hierarchical=True))
    n = repl.num_replicas
    report, counted = _report_and_count(repl, _reduce_step, _batch(n), _params())
    _assert_matches(report, counted)
    assert [(r.kind, r.group) for r in report.rows] == [
        ("reduce_scatter", "cores"),
        ("all_sum", "workers"),
        ("all_gather", "cores"),
    ]
    b = sum(x.size * 4 for x in jax.tree.leaves(_params()))
    padded = -(-b // 4 // c) * c * 4
    expected = (c - 1) / c * padded + 2 * (w - 1) / w * padded / c + (c - 1) * padded / c
    assert np.isclose(report.total_sent_bytes, expected)
    assert all(r.tensors == len(_params()) for r in report.rows)


# -- ZeRO: every state leaf sharded, or replicated with its reason --------------------------------

#: A small model: three leaves under ZeRO's 64 KiB threshold and one above it (``big``, 128 KiB).
ZERO_SHAPES = {"w0": (16, 16), "b0": (16,), "big": (16, 2048), "b1": (2048,)}


def _zero_problem(n):
    import optax

    assert 16 % n == 0, "the shapes below divide by the replicas"
    params = {name: jnp.full(shape, 0.01, jnp.float32) for name, shape in ZERO_SHAPES.items()}
    tx = optax.adam(1e-3)

    def step(s, b):
        def loss(p):
            h = jnp.tanh(b["x"] @ p["w0"] + p["b0"])
            return jnp.mean(jnp.tanh(h @ p["big"] + p["b1"]) ** 2)

        g = rp.all_mean(jax.grad(loss)(s["p"]))
        updates, opt = tx.update(g, s["o"], s["p"])
        return {"p": jax.tree.map(lambda a, u: a + u, s["p"], updates), "o": opt}, {}

    return step, {"p": params, "o": tx.init(params)}, {"x": np.ones((2 * n, 16), np.float32)}


def _nbytes(shape):
    return 4 * int(np.prod(shape))


def _zero_report(n, **options):
    step, state, batch = _zero_problem(n)
    return rp.Replicator(1, n, passes=rp.PassManager.default(**options)).explain(step, batch, state), state


def test_explain_accounts_for_every_leaf_a_zero_stage_leaves_replicated(n_devices):
    n = n_devices
    small = [name for name, shape in ZERO_SHAPES.items() if _nbytes(shape) < 64 * 1024]  # w0, b0, b1
    moments_bytes = 2 * sum(_nbytes(ZERO_SHAPES[name]) for name in small)  # Adam's mu and nu of each
    for stage, under in ((1, 2 * len(small)), (3, 3 * len(small))):
        report, state = _zero_report(n, zero=stage)
        zero = report.zero
        assert zero.stage == stage and zero.min_tensor_bytes == 64 * 1024
        assert zero.num_leaves == len(jax.tree.leaves(state))
        assert len(zero.sharded) + len(zero.replicated) == len(jax.tree.leaves(state))
        assert not set(zero.sharded) & {leaf.path for leaf in zero.replicated}
        assert len(zero.sharded) == (2 if stage == 1 else 3)  # big's mu and nu (and big itself at stage 3)
        groups = zero.by_reason()
        assert [leaf.path for leaf in groups["no-dividing-axis"]] == ["state['o'][0].count"]
        below = groups["under-threshold"]
        assert len(below) == under
        below_bytes = moments_bytes + (sum(_nbytes(ZERO_SHAPES[name]) for name in small) if stage == 3 else 0)
        assert sum(leaf.nbytes for leaf in below) == below_bytes
        if stage == 1:  # the four parameters: stage 3 splits them
            assert sorted(leaf.path for leaf in groups["parameter"]) == sorted(
                f"state['p']['{k}']" for k in ZERO_SHAPES
            )
        text = str(report)
        human = f"{below_bytes / 1024:.1f} KiB"
        assert (
            f"{under} leaves, {human} in all, stay replicated under the 64.0 KiB threshold "
            f"(PassManager.default(zero={stage}, shard_optimizer_min_bytes=0) splits them)"
        ) in text, text
        # What the line claims: without the threshold the same stage splits them.
        unthresholded, _ = _zero_report(n, zero=stage, shard_optimizer_min_bytes=0)
        assert {leaf.path for leaf in below} <= set(unthresholded.zero.sharded)
        assert [leaf.reason for leaf in unthresholded.zero.replicated] == (
            ["no-dividing-axis", *["parameter"] * 4] if stage == 1 else ["no-dividing-axis"]
        )


def test_explain_predicts_the_stages_with_the_pipelines_threshold(n_devices):
    """The state at each stage is predicted with the pipeline's shard_optimizer_min_bytes, not the default."""
    n = n_devices
    report, _ = _zero_report(n, zero=1, shard_optimizer_min_bytes=0)
    params = sum(_nbytes(shape) for shape in ZERO_SHAPES.values())
    expected = params + 2 * params // n + 4  # parameters whole, Adam's moments in 1/n, the int32 count
    assert report.state_bytes == expected
    assert report.state_bytes_by_stage[1] == expected
    assert "PassManager.default(zero=k, shard_optimizer_min_bytes=0), predicted" in str(report)


def test_explain_without_zero_has_no_account(n_devices):
    report, _ = _zero_report(n_devices)
    assert report.zero is None and "stay replicated" not in str(report)
