"""Plans as artifacts: the plan format, and the tools that read plans.

In: a `Partition` (partc.solve) and what emit wrote, or a plan.yaml on disk. Out: a typed `Plan`
(partc.plans.plan: plan.yaml schema v1, validated against partc/plans/schema/ before anything
reads it), and what the tools make of plans: `check` (is a checked-in plan what the model compiles
to now?), `diff` (what differs between two plans), `report` (`partc show`: summary, PNG, HTML).
Reading, diffing and showing a plan imports no torch and loads no stage file.
"""
