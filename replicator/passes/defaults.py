"""The default passes, in order, with the optional ones switched."""

from __future__ import annotations

from replicator.pass_manager.contract import Pass
from replicator.pass_manager.manager import HOOKS, check_options
from replicator.passes.capture import CaptureCollectives
from replicator.passes.check_invariance import CheckReplicaInvariance
from replicator.passes.compress import CompressCommunication
from replicator.passes.fuse_collectives import DEFAULT_MAX_TENSOR_BYTES, DEFAULT_THRESHOLD_BYTES, FuseCollectives
from replicator.passes.hierarchical import HierarchicalAllReduce
from replicator.passes.lower_collectives import LowerCollectives
from replicator.passes.shard_optimizer import DEFAULT_MIN_TENSOR_BYTES, ShardOptimizerUpdate
from replicator.passes.share_slice_kernels import ShareSliceKernels
from replicator.passes.simplify import Simplify

__all__ = ["default_passes"]


@check_options(renamed={"zero_stage": "zero"})
def default_passes(
    *,
    zero: int = 0,
    shard_optimizer: bool = False,
    shard_optimizer_min_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    hierarchical: bool = False,
    compress: bool = False,
    all_reduce_algorithm: str = "native",
    fuse_threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
    fuse_max_tensor_bytes: int | None = DEFAULT_MAX_TENSOR_BYTES,
) -> list[Pass]:
    """The default passes, in order, with the optional ones switched.

    Raw ``lax`` collectives become placeholders first (``capture-collectives``);
    checks run next so their errors point at the collectives the user wrote;
    optimizations work on placeholders; lowering comes last. The defaults
    were chosen by ``benchmarks/bench_step.py`` (see BENCHMARKS.md).

    Args:
      zero: the ZeRO level (DeepSpeed's "stage", ``shard-optimizer-update``): 0 none;
        1 optimizer state stored 1/N per device; 2 also the reduced gradients
        kept as 1/N shards (a global norm is computed on the shards); 3 also
        the parameters stored 1/N per device and all-gathered for each use.
        Each level shards only what the variance analysis proves identical on
        every replica (``explain`` says what stays replicated and why).
        ``zero_stage=`` is its old name (a ``DeprecationWarning``).
      shard_optimizer: ``True`` is ``zero=1`` (the older spelling). Off by default: it
        divides optimizer-state memory by N but was not faster on every workload measured
        (BENCHMARKS.md).
      shard_optimizer_min_bytes: with ZeRO, gradients and state leaves smaller than this stay
        whole (replicated); ``explain`` counts them.
      hierarchical: ``hierarchical-allreduce`` over ('workers', 'cores').
      compress: ``compress-communication``: f32 all-reduce payloads as bf16.
      all_reduce_algorithm: ``'native'``, ``'ring'`` or ``'reduce_broadcast'``.
      fuse_threshold_bytes: the largest fused all-reduce bucket.
      fuse_max_tensor_bytes: larger tensors are not fused (``None``: all are).

    Raises:
      TypeError: an unknown option (the message names the closest and lists them all), or both ``zero=`` and
        ``zero_stage=``.
      ValueError: ``zero`` not 0, 1, 2 or 3.

    Example::

        repl = rp.Replicator(2, 4, passes=rp.PassManager(default_passes(hierarchical=True)))
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}: ZeRO's levels are 0 (off), 1, 2 and 3.")
    if shard_optimizer and zero == 0:
        zero = 1
    passes: list[Pass] = [CaptureCollectives(), CheckReplicaInvariance(), Simplify()]
    if zero:
        passes.append(ShardOptimizerUpdate(min_tensor_bytes=shard_optimizer_min_bytes, stage=zero))
    passes.append(FuseCollectives(threshold_bytes=fuse_threshold_bytes, max_tensor_bytes=fuse_max_tensor_bytes))
    passes.append(ShareSliceKernels())
    if compress:
        passes.append(CompressCommunication())
    if hierarchical:
        passes.append(HierarchicalAllReduce())
    passes.append(LowerCollectives(algorithms={"all_reduce": all_reduce_algorithm}))
    return passes


HOOKS.default_passes = default_passes
