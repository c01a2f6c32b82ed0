"""Hardware: the devices and clusters a plan is solved for.

In: device and cluster YAML (configs/, shipped with the package; or a path), or this machine
(`--cluster local`). Out: frozen `DeviceSpec` and `ClusterSpec` (partc.hardware.specs) in base
units, which the cost model and the solver read. `units` parses quantities with units, `configs`
reads and validates the files, `local` detects this machine, `calibration` measures its CPU.
Specs and configs import no torch.
"""
