"""analysis/records.py: what a step sends (estimated bytes per collective) and where a rewritten equation comes
from (the origin a pass hands on to the placeholders it makes)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import replicator as rp
from replicator.analysis.records import estimated_sent_bytes, pass_on_origin
from replicator.core.graph import Origin


def test_sent_bytes_count_an_axis_of_unknown_size_as_one_replica():
    """``estimated_sent_bytes``: a psum sends ``2 (n - 1) / n`` of its bytes over ``n`` replicas; an axis not in
    ``axis_sizes`` is one replica (nothing sent over it)."""
    x = jnp.ones((4, 8), jnp.float32)  # 128 bytes
    eqns = jax.make_jaxpr(lambda x: lax.psum(x, "i"), axis_env=[("i", 4)])(x).jaxpr.eqns
    assert estimated_sent_bytes(eqns, {"i": 4}) == 2 * 3 / 4 * 128
    assert estimated_sent_bytes(eqns, {"j": 4}) == 0.0


def test_pass_on_origin_marks_only_the_placeholders(repl):
    """The origin goes to the placeholders among the new equations (by first result), not to the code around them."""
    batch = {"x": np.ones((repl.num_replicas, 3), np.float32)}
    jaxpr = repl.lower(lambda b: rp.all_sum(b["x"] * 2.0) + 1.0, batch).traced.jaxpr.jaxpr
    origin = Origin(2, ("train.py:10",))
    (placeholder,) = [e for e in jaxpr.eqns if e.primitive.name == "rp.all_reduce"]
    assert len(jaxpr.eqns) == 3  # mul, the all_sum, add
    assert pass_on_origin(origin, jaxpr.eqns) == {placeholder.outvars[0]: origin}
