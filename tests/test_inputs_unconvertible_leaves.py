"""A batch leaf that NumPy cannot convert (a framework tensor that refuses) is a TypeError naming the leaf."""

from __future__ import annotations

import numpy as np
import pytest

import replicator as rp


class _DeviceTensor:
    """A stand-in for another framework's tensor that refuses to become a NumPy array (a PyTorch CUDA tensor,
    or one that requires grad: ``__array__`` raises)."""

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        raise RuntimeError("can't convert cuda:0 device type tensor to numpy; use Tensor.cpu() first")


@pytest.mark.parametrize("given", ["batch", "input_fn"])
def test_a_leaf_numpy_cannot_convert_is_a_type_error_naming_the_leaf_and_why(n_devices: int, given: str) -> None:
    repl = rp.Replicator(1, n_devices)
    batch = {"label": np.zeros((n_devices,), np.int32), "image": _DeviceTensor()}
    data = batch if given == "batch" else (lambda ctx: iter([batch]))
    with pytest.raises(TypeError, match=r"batch\['image'\] is a _DeviceTensor, not an array") as caught:
        repl.run(lambda b: rp.all_sum(b["label"]), data)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "Tensor.cpu()" in str(caught.value.__cause__)  # the framework's own reason, chained
