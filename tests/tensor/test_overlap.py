"""Collective matmul: the rings of ``replicator/tensor/overlap.py`` and the rewrite that uses them.

The rings on their own (inside ``shard_map``) against NumPy on the global operands, with batch
dimensions and either operand; then ``collective_matmul=True`` on steps under sequence parallelism
against ``jax.jit`` of the same step on one device on the global batch (1e-6 relative, T = 2 and 4):
the forward and the gradient, the graph (``collective-permute`` where the all-gathers and
reduce-scatters of the ringed matmuls were, none of those left), the list of collectives (each ring as
what it is, with the bytes of the collective it replaces), the plain collective kept where the pattern
is not exact (the gathered dimension is the one the product contracts), and the option off leaving the
rewrite as it was.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.tensor import TensorParallel
from replicator.tensor.overlap import all_gather_matmul, matmul_reduce_scatter
from replicator.tensor.parallelize import sent_bytes
from tests.tensor.test_sequence import PLAN, B, F, H, S, X, _loss, _norm, _params, _step

RINGS = ("ring all-gather matmul", "ring matmul reduce-scatter")


def _close(got, want, tol=1e-6):
    """Equal within ``tol`` relative to the reference's largest magnitude (at least 1), leaf by leaf."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = max(1.0, float(np.max(np.abs(np.asarray(b)))))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=tol * scale)


def _mesh(size: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:size]), ("tensor",))


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# -- the rings on their own --------------------------------------------------------------------

BATCHED = (((2,), (1,)), ((0,), (0,)))  # (b, s, h) x (b, h, f) -> (b, s, f)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "operand, dim, specs, out_spec",
    [
        (0, 1, (P(None, "tensor"), P()), P()),  # the activation gathered on its sequence
        (1, 2, (P(), P(None, None, "tensor")), P()),  # the right operand gathered on its free columns
    ],
)
def test_the_all_gather_ring_equals_the_product_of_the_gathered_operand(size, operand, dim, specs, out_spec):
    lhs, rhs = _random(2, 8, 4), _random(2, 4, 8, seed=1)

    def ring(a, b):
        return all_gather_matmul(a, b, BATCHED, operand=operand, dim=dim, axis="tensor", size=size)

    f = jax.shard_map(ring, mesh=_mesh(size), in_specs=specs, out_specs=(out_spec, out_spec), check_vma=False)
    product, gathered = f(lhs, rhs)
    np.testing.assert_allclose(product, np.einsum("bsh,bhf->bsf", lhs, rhs), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(gathered, (lhs, rhs)[operand])  # the blocks the ring passed, in place


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dim, out_spec", [(1, P(None, "tensor")), (2, P(None, None, "tensor"))])
def test_the_reduce_scatter_ring_equals_the_scattered_sum_of_the_products(size, dim, out_spec):
    lhs, rhs = _random(2, 8, 8), _random(2, 8, 8, seed=1)  # contracted over h, split over the devices

    def ring(a, b):
        return matmul_reduce_scatter(a, b, BATCHED, dim=dim, axis="tensor", size=size)

    specs = (P(None, None, "tensor"), P(None, "tensor"))
    f = jax.shard_map(ring, mesh=_mesh(size), in_specs=specs, out_specs=out_spec, check_vma=False)
    np.testing.assert_allclose(f(lhs, rhs), np.einsum("bsh,bhf->bsf", lhs, rhs), rtol=1e-5, atol=1e-5)


def test_a_ring_on_a_contracted_or_batch_dimension_is_refused():
    a = jnp.ones((2, 4, 4))
    with pytest.raises(ValueError, match="contracted or a batch"):
        all_gather_matmul(a, a, BATCHED, operand=0, dim=2, axis="tensor", size=2)
    with pytest.raises(ValueError, match="batch one"):
        matmul_reduce_scatter(a, a, BATCHED, dim=0, axis="tensor", size=2)


# -- the rewrite ---------------------------------------------------------------------------------


def _mlp_blocks(p, x):
    """Two pre-norm MLP blocks and a loss: the first block's input is the batch (whole), the rest is split
    on the sequence between the blocks."""
    for n in ("a", "b"):
        x = x + jax.nn.gelu(_norm(x, p["g"]) @ p[n]["fc1"]) @ p[n]["fc2"]
    return p, jnp.mean(x**2)


def _mlp_params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "g": jnp.linspace(0.5, 1.5, H),
        **{
            n: {"fc1": jax.random.normal(k[2 * i], (H, F)) / 4, "fc2": jax.random.normal(k[2 * i + 1], (F, H)) / 4}
            for i, n in enumerate("ab")
        },
    }


MLP_PLAN = {"*/fc1": "column", "*/fc2": "row"}


@pytest.mark.parametrize("size", [2, 4])
def test_ringed_matmuls_leave_no_all_gather_or_reduce_scatter_in_the_graph(size):
    p = _mlp_params()
    plain = TensorParallel(_mlp_blocks, MLP_PLAN, size=size, sequence_parallel=1)
    ring = TensorParallel(_mlp_blocks, MLP_PLAN, size=size, sequence_parallel=1, collective_matmul=True)
    want = jax.jit(_mlp_blocks)(p, X)
    _close(ring(ring.shard(p, X), X), want)
    _close(ring(ring.shard(p, X), X), plain(plain.shard(p, X), X))
    # Each ring where its collective was: block a's output scattered, block b's input gathered and its
    # output scattered; the loss, a partial sum, summed as before. The bytes are those of the plain rewrite.
    got, before = ring.collectives(p, X), plain.collectives(p, X)
    assert [c.kind for c in before] == ["reduce-scatter", "all-gather", "reduce-scatter", "all-reduce"]
    assert [c.kind for c in got] == ["ring matmul reduce-scatter", "ring all-gather matmul"] + [
        "ring matmul reduce-scatter",
        "all-reduce",
    ]
    assert [(c.shape, sent_bytes(c, size)) for c in got] == [(c.shape, sent_bytes(c, size)) for c in before]
    assert "ring all-gather matmul" in ring.explain(p, X)
    # The lowered graph: T - 1 ppermutes per ring, no all-gather or reduce-scatter; XLA's compiled one too.
    lowered = ring.lower(p, X)
    text = lowered.as_text()
    assert text.count("stablehlo.collective_permute") == 3 * (size - 1)
    assert not re.search(r"stablehlo\.(all_gather|reduce_scatter)", text)
    compiled = lowered.compile().as_text()
    assert "collective-permute" in compiled
    assert not re.search(r"all-gather|reduce-scatter", compiled)
    plain_text = plain.lower(p, X).as_text()
    assert "collective_permute" not in plain_text and "stablehlo.all_gather" in plain_text


@pytest.mark.parametrize("size", [2, 4])
def test_the_forward_and_the_gradient_of_a_transformer_equal_one_device(size):
    """Two transformer blocks (attention with split heads, an MLP) under sequence parallelism: the loss and
    its gradient (``jax.grad`` inside the step, the backward's matmuls rewritten too), and one SGD step."""

    def grads(params, x):
        loss, g = jax.value_and_grad(_loss)(params, x)
        return g, loss

    params = _params()
    for step in (grads, _step):
        want = jax.jit(step)(params, X)
        ring = TensorParallel(step, PLAN, size=size, sequence_parallel=1, collective_matmul=True)
        plain = TensorParallel(step, PLAN, size=size, sequence_parallel=1)
        got = ring(ring.shard(params, X), X)
        _close(got, want)
        _close(got, plain(plain.shard(params, X), X))
        kinds = [c.kind for c in ring.collectives(params, X)]
        # Forward: both blocks' two row-parallel outputs scattered, the second block's two column-parallel
        # regions' inputs gathered (q, k and v share one ring: the ring's gathered input is kept), all as
        # rings. The backward gathers each row-parallel output gradient first for its weight's gradient
        # (the sequence contracted: a plain all-gather, whose value the input gradient's matmul reuses).
        assert kinds.count("ring matmul reduce-scatter") == 4 and kinds.count("ring all-gather matmul") == 3, kinds
        assert kinds.count("all-gather") == 4, kinds


def test_a_gather_on_the_contracted_dimension_stays_an_all_gather():
    def step(p, x):
        v = x @ p["w3"]  # the batch (whole) by a column-split weight: split on its columns
        y = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]  # reduce-scattered on the sequence (a ring)
        g = jnp.einsum("bsh,bsf->hf", y, v)  # y gathered on the sequence, which this product contracts
        return p, jnp.sum(g**2)

    k = jax.random.split(jax.random.key(1), 3)
    p = {
        "w1": jax.random.normal(k[0], (H, F)) / 4,
        "w2": jax.random.normal(k[1], (F, H)) / 4,
        "w3": jax.random.normal(k[2], (H, F)) / 4,
    }
    tp = TensorParallel(step, {"w1": "column", "w2": "row", "w3": "column"}, size=2, sequence_parallel=1)
    ring = TensorParallel(
        step, {"w1": "column", "w2": "row", "w3": "column"}, size=2, sequence_parallel=1, collective_matmul=True
    )
    _close(ring(ring.shard(p, X), X), jax.jit(step)(p, X))
    assert [(c.kind, c.shape) for c in ring.collectives(p, X)] == [
        ("ring matmul reduce-scatter", (B, S, H)),
        ("all-gather", (B, S, H)),
        ("all-reduce", ()),
    ]
    assert [c.kind for c in tp.collectives(p, X)] == ["reduce-scatter", "all-gather", "all-reduce"]


def test_off_the_rewrite_is_unchanged():
    p = _mlp_params()
    default = TensorParallel(_mlp_blocks, MLP_PLAN, size=2, sequence_parallel=1)
    off = TensorParallel(_mlp_blocks, MLP_PLAN, size=2, sequence_parallel=1, collective_matmul=False)
    assert off.lower(p, X).as_text() == default.lower(p, X).as_text()
    assert not any(c.kind in RINGS for c in off.collectives(p, X))


@pytest.mark.parametrize("size", [2, 4])
def test_without_sequence_parallelism_collective_matmul_has_no_ring_to_make(size):
    # The row-parallel products are all-reduced whole (no reduce-scatter, no all-gather): nothing to ring,
    # and asking for rings changes nothing.
    p = _mlp_params()
    plain = TensorParallel(_mlp_blocks, MLP_PLAN, size=size)
    ring = TensorParallel(_mlp_blocks, MLP_PLAN, size=size, collective_matmul=True)
    _close(ring(ring.shard(p, X), X), jax.jit(_mlp_blocks)(p, X))
    assert [c.kind for c in ring.collectives(p, X)] == [c.kind for c in plain.collectives(p, X)]
    assert {c.kind for c in ring.collectives(p, X)} == {"all-reduce"}


def test_collective_matmul_inside_a_replicator_equals_one_device():
    def step(params, x):
        loss, g = jax.value_and_grad(_loss)(params, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, rp.all_mean(g)), rp.all_mean(loss)

    par = rp.Parallelism(tensor=2, tensor_plan=PLAN, sequence_parallel=1, collective_matmul=True)
    repl = rp.Replicator(1, 8, parallelism=par)
    xs = jax.random.normal(jax.random.key(3), (4 * B, S, H))  # 4 data replicas of B rows
    got, loss = repl.run(step, xs, _params())
    want, want_loss = jax.jit(_step)(_params(), xs)
    _close(got, want)
    np.testing.assert_allclose(np.asarray(loss), float(want_loss), rtol=1e-6)
    kinds = [c.kind for c in repl.lower(step, xs, _params()).final.tensor.collectives]
    assert kinds.count("ring matmul reduce-scatter") == 4 and kinds.count("ring all-gather matmul") == 3, kinds
    assert "ring all-gather matmul" in str(repl.explain(step, xs, _params()))
    with pytest.raises(ValueError, match="give tensor=T"):
        rp.Parallelism(collective_matmul=True)
    with pytest.raises(ValueError, match="True or False"):
        rp.Parallelism(tensor=2, tensor_plan=PLAN, collective_matmul=1)
    with pytest.raises(ValueError, match="collective_matmul with stages=2"):
        rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=2, tensor_plan=PLAN, stages=2, collective_matmul=True))
