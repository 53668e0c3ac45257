"""Read-only facts about a step graph: which values may differ between replicas
(:mod:`~replicator.analysis.invariance`) and what its collectives send
(:mod:`~replicator.analysis.records`). Nothing here rewrites a graph."""
