"""Pipeline parallelism: a step cut into stages at its ``rp.stage_boundary`` markers.

Not the pass manager (:mod:`replicator.pass_manager`): a *stage* here is a part
of the model that some devices run, one after another on micro-batches. This
layer sits above the passes (a stage's program goes through them) and below
the cost model and the runtime. Modules, each testable on its own:

* :mod:`replicator.stages.split`: which stage runs each equation of a traced
  step, what crosses each boundary, tied parameters, the clear errors;
* :mod:`replicator.stages.scan_split`: a stack of layers under one ``lax.scan`` cut into
  stages without markers (``split_scan``);
* :mod:`replicator.stages.programs`: each stage's forward and backward of one
  micro-batch, cut out of the split;
* :mod:`replicator.stages.schedule`: schedules as data (GPipe, 1F1B tick
  tables), their bubble and per-stage live activations;
* :mod:`replicator.stages.lower`: any table run as one loop of ticks over S
  devices (``shard_map`` + ``lax.switch`` + ``ppermute``), a value and gradient;
* :mod:`replicator.stages.train`: a loss and an optax optimizer as the step a
  data-parallel user writes, built as the user's own step (below);
* :mod:`replicator.stages.user_step`: the user's own step (``Replicator.run`` of a pipelined
  ``Replicator``), its update phase cut from it and run per stage: the one build
  of a pipelined step (:mod:`replicator.stages.data_replicas`: its batch shares,
  folding and ZeRO level checked);
* :mod:`replicator.stages.replicas`: data-parallel replicas of the pipeline
  (the ``('stages', 'workers', 'cores')`` mesh), the ``Replicator`` option and
  the description of a pipelined step;
* :mod:`replicator.stages.gpipe`: the first increment's entry point (the
  ``"gpipe"`` table).

Design: docs/design/pipeline-parallelism.md.
"""

from replicator.stages.gpipe import gpipe_value_and_grad as gpipe_value_and_grad
from replicator.stages.lower import pipeline_value_and_grad as pipeline_value_and_grad
from replicator.stages.programs import DATA_AXES as DATA_AXES
from replicator.stages.programs import StagePrograms as StagePrograms
from replicator.stages.programs import stage_programs as stage_programs
from replicator.stages.replicas import PipelinedReplicas as PipelinedReplicas
from replicator.stages.replicas import PipelineReport as PipelineReport
from replicator.stages.replicas import StageReport as StageReport
from replicator.stages.replicas import describe as describe
from replicator.stages.replicas import pipeline_mesh as pipeline_mesh
from replicator.stages.scan_split import split_scan as split_scan
from replicator.stages.schedule import Schedule as Schedule
from replicator.stages.schedule import ScheduleStats as ScheduleStats
from replicator.stages.schedule import make_schedule as make_schedule
from replicator.stages.schedule import schedule_stats as schedule_stats
from replicator.stages.split import Boundary as Boundary
from replicator.stages.split import StageSplit as StageSplit
from replicator.stages.split import StageSplitError as StageSplitError
from replicator.stages.split import StageSum as StageSum
from replicator.stages.split import split_stages as split_stages
from replicator.stages.train import PipelineTrainStep as PipelineTrainStep
from replicator.stages.train import pipeline_train_step as pipeline_train_step
from replicator.stages.user_step import PipelinedStep as PipelinedStep

__all__ = [
    "DATA_AXES",
    "Boundary",
    "PipelineReport",
    "PipelinedReplicas",
    "PipelinedStep",
    "StageReport",
    "PipelineTrainStep",
    "Schedule",
    "ScheduleStats",
    "StagePrograms",
    "StageSplit",
    "StageSplitError",
    "StageSum",
    "describe",
    "gpipe_value_and_grad",
    "make_schedule",
    "pipeline_mesh",
    "pipeline_train_step",
    "pipeline_value_and_grad",
    "schedule_stats",
    "split_scan",
    "split_stages",
    "stage_programs",
]
