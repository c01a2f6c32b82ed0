"""Strategies: one StageProblem (a pipeline shape's integer problem) -> a stage per block.

`cpsat` optimises over the block DAG with OR-Tools CP-SAT and proves a bound; `chain_dp` is the
exact dynamic program over contiguous cuts of a topological order; `baselines` are the cuts users
hand-pick today (equal layers, equal parameters). All are priced by the same objective.
"""
