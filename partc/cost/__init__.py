"""Cost: what every OpGraph node costs on a device, at any micro-batch size.

In: an OpGraph (and its capture) and a DeviceSpec. Out: a `CostTable` (partc.cost.table): per node
forward and backward seconds and bytes saved for backward, each a `Curve` (piecewise linear) of the
micro-batch size. Two sources: the analytic roofline (`roofline`, from the device config, with
saved activations measured on meta by `activations`) and measurement on the device itself
(`measured`: `partc profile`, through `torch_profiler` and `ort_profiler`). `plan_costs` picks the
table a plan is solved with. The table itself (`table`, `op_classes`) imports no torch.
"""
