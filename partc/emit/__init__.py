"""Emit: capture + Partition -> a plan directory, and its proof.

In: the `CaptureResult` (partc.frontend) and the `Partition` (partc.solve). Out: a plan directory:
one TorchScript file per (virtual) stage and plan.yaml (partc.plans). `stage_graph` cuts the
exported program into one FX graph per stage (with relays), `stage_code` traces and saves them,
`stage_weights` moves weights by FQN, `compile` runs every pass (`partc compile`), and `verify`
proves the stages compute what the model computes (`partc verify`).
"""
