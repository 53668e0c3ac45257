"""Pipeline parallelism: a step cut into stages at its ``rp.stage_boundary`` markers.

Not the pass pipeline (:mod:`replicator.pipeline`): a *stage* here is a part
of the model that some devices run, one after another on micro-batches. This
layer sits above the passes (a stage's program goes through them) and below
the cost model and the runtime. Modules, each testable on its own:

* :mod:`replicator.stages.split`: which stage runs each equation of a traced
  step, what crosses each boundary, tied parameters, the clear errors;
* :mod:`replicator.stages.programs`: each stage's forward and backward of one
  micro-batch, cut out of the split;
* :mod:`replicator.stages.gpipe`: a GPipe prototype over S devices
  (``shard_map`` + ``ppermute``), checked against one device.

Design: docs/design/pipeline-parallelism.md.
"""

from replicator.stages.gpipe import gpipe_value_and_grad as gpipe_value_and_grad
from replicator.stages.programs import StagePrograms as StagePrograms
from replicator.stages.programs import stage_programs as stage_programs
from replicator.stages.split import Boundary as Boundary
from replicator.stages.split import StageSplit as StageSplit
from replicator.stages.split import StageSplitError as StageSplitError
from replicator.stages.split import StageSum as StageSum
from replicator.stages.split import split_stages as split_stages

__all__ = [
    "Boundary",
    "StagePrograms",
    "StageSplit",
    "StageSplitError",
    "StageSum",
    "gpipe_value_and_grad",
    "split_stages",
    "stage_programs",
]
