"""What both compiles and runs graphs: translation validation
(:mod:`~replicator.tools.validate`), pass bisection (:mod:`~replicator.tools.bisect`)
and calibration of the cost models on real devices (:mod:`~replicator.tools.calibrate`)."""

from replicator.tools.bisect import BisectReport as BisectReport
from replicator.tools.bisect import bisect_passes as bisect_passes
from replicator.tools.calibrate import calibrate as calibrate
from replicator.tools.calibrate import calibrate_compute as calibrate_compute
from replicator.tools.validate import GraphRunner as GraphRunner

__all__ = ["BisectReport", "GraphRunner", "bisect_passes", "calibrate", "calibrate_compute"]
