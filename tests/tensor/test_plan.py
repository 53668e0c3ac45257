"""TensorPlan: globs over state paths -> placements; every way a plan can be wrong is refused."""

from __future__ import annotations

import numpy as np
import pytest

from replicator.tensor import REPLICATED, Shard, TensorPlacementError, TensorPlan, leaf_paths

STATE = {
    "blocks": [
        {"mlp": {"fc1": {"kernel": np.zeros((8, 32)), "bias": np.zeros(32)}, "fc2": {"kernel": np.zeros((32, 8))}}},
        {"mlp": {"fc1": {"kernel": np.zeros((8, 32)), "bias": np.zeros(32)}, "fc2": {"kernel": np.zeros((32, 8))}}},
    ],
    "embed": np.zeros((48, 8)),
    "step": np.zeros((), np.int32),
}


def test_paths_join_keys_and_indices_with_slashes():
    assert leaf_paths(STATE)[:3] == ["blocks/0/mlp/fc1/bias", "blocks/0/mlp/fc1/kernel", "blocks/0/mlp/fc2/kernel"]


def test_column_and_row_split_the_last_and_second_to_last_dimension_and_unnamed_leaves_are_none():
    plan = TensorPlan({"blocks/*/mlp/fc1/kernel": "column", "blocks/*/mlp/fc2/kernel": "row"})
    got = dict(zip(leaf_paths(STATE), plan.placements(STATE, size=4), strict=True))
    assert got["blocks/1/mlp/fc1/kernel"] == Shard(1)
    assert got["blocks/0/mlp/fc2/kernel"] == Shard(0)
    assert got["blocks/0/mlp/fc1/bias"] is None and got["step"] is None


def test_double_star_spans_components_and_the_first_matching_pattern_decides():
    plan = TensorPlan({"**/fc1/*": "replicated", "**/kernel": "column", "embed": 0})
    got = dict(zip(leaf_paths(STATE), plan.placements(STATE, size=2), strict=True))
    assert got["blocks/0/mlp/fc1/kernel"] == REPLICATED
    assert got["blocks/0/mlp/fc2/kernel"] == Shard(1)
    assert got["embed"] == Shard(0)


def test_a_trailing_double_star_takes_every_component_left_and_none():
    """``a/**`` is everything under ``a`` (``**`` at the end matches the rest of the path, however many
    components) and ``a`` itself; ``**`` alone is every leaf."""
    plan = TensorPlan({"blocks/1/**": "replicated", "embed/**": 0, "blocks/**": "column", "**": "replicated"})
    got = dict(zip(leaf_paths(STATE), plan.placements(STATE, size=2), strict=True))
    assert got["blocks/1/mlp/fc1/kernel"] == got["blocks/1/mlp/fc2/kernel"] == REPLICATED
    assert got["embed"] == Shard(0)  # "embed/**": zero components after "embed"
    assert got["blocks/0/mlp/fc1/kernel"] == got["blocks/0/mlp/fc2/kernel"] == Shard(1)
    assert got["blocks/0/mlp/fc1/bias"] == Shard(0)
    assert got["step"] == REPLICATED  # "**": every leaf the patterns before it left


def test_a_pattern_that_matches_no_leaf_is_refused_listing_the_paths():
    with pytest.raises(TensorPlacementError, match=r"\['blocks/\*/attn/wq'\] match no leaf.*blocks/0/mlp/fc1/bias"):
        TensorPlan({"blocks/*/attn/wq": "column", "embed": 0}).placements(STATE, size=2)


def test_a_dimension_the_degree_does_not_divide_is_refused_naming_leaf_shape_and_degree():
    with pytest.raises(TensorPlacementError, match=r"'embed' \(shape \(48, 8\)\) on dimension 1 of size 8.*degree 16"):
        TensorPlan({"embed": "column"}).placements(STATE, size=16)


def test_a_split_of_a_scalar_or_a_missing_dimension_is_refused():
    with pytest.raises(TensorPlacementError, match="'step'.*has 0"):
        TensorPlan({"step": "column"}).placements(STATE, size=2)
    with pytest.raises(TensorPlacementError, match="names dimension 2"):
        TensorPlan({"embed": 2}).placements(STATE, size=2)
    with pytest.raises(TensorPlacementError, match="names dimension -1"):
        TensorPlan({"blocks/*/mlp/fc1/bias": "row"}).placements(STATE, size=2)


def test_an_unknown_style_is_refused_when_the_plan_is_made():
    with pytest.raises(TensorPlacementError, match="style 'colum'"):
        TensorPlan({"embed": "colum"})
    with pytest.raises(TensorPlacementError, match="style True"):
        TensorPlan({"embed": True})


def test_the_list_of_paths_in_the_error_is_cut_after_12_with_dots():
    twelve = {f"w{i:02d}": np.zeros(2) for i in range(12)}
    with pytest.raises(TensorPlacementError) as info:
        TensorPlan({"nope": 0}).placements(twelve, size=2)
    assert "w11." in str(info.value) and "..." not in str(info.value)
    with pytest.raises(TensorPlacementError, match=r"w11, \.\.\."):
        TensorPlan({"nope": 0}).placements({**twelve, "w12": np.zeros(2)}, size=2)
