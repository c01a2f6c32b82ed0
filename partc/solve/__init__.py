"""Solve: CostTable + cluster + global batch -> Partition, the hybrid-parallel plan.

`coarsen` groups the OpGraph into a BlockGraph of convex blocks; `search` enumerates pipeline
shapes (stages x replicas x micro-batches x schedule x checkpointing x placement), prices each as a
`StageProblem` in integers (`stage_problem`, memory from `memory`), cuts its stages with a
strategy (`strategies`: CP-SAT, the exact chain DP, the uniform and params baselines), and
`simulator` replays the winner's schedule. Out: a `Partition` (`partition`).

The solver core imports no torch (enforced by ruff's banned-api rule and a test), so it runs
anywhere, in milliseconds per shape.
"""
