"""Which batch sizes the whole model can be measured at on one device.

A measured profile runs the whole model, forward and backward, on one device of this machine
(partc.cost.measured). partc plans models too large for one device, and those cannot be measured
whole: on a GPU the attempt ends in an out-of-memory error, on a CPU in the kernel's OOM killer
(Linux hands out memory it does not have and kills a process that touches too much of it), which
takes compile down with it. So before measuring at a size, compile asks whether the whole model
trains at that size in one device's usable memory (`usable_memory`: the device's bytes less the
training config's margin), by the same memory model that cuts the stages (partc.solve.memory,
the model as one stage of one micro-batch, without optimizer state: the profile takes no
optimizer step). partc.cost.plan_costs.measurement then measures at the sizes that fit, or the
model is priced by the roofline.

Cheap first: an upper bound from the graph alone (every operator's outputs and the parameters,
with room for gradients, casts and the backward's transients) settles most models without the
meta-device pass the memory model's saved activations need.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from partc.cost.plan_costs import plan_costs
from partc.cost.table import CostTable
from partc.frontend.capture import CaptureResult
from partc.hardware.specs import DeviceSpec
from partc.options import TrainingConfig
from partc.progress import Progress
from partc.solve.memory import stage_memory, usable_memory

# The cheap bound's factors: parameters held as weights, gradients, a bf16 copy and room to
# spare; operator outputs as saved activations, the backward's gradients of them and slack for
# what kernels keep besides their outputs (attention's math path, dropout's masks).
_PARAMETER_FACTOR = 4
_OUTPUT_FACTOR = 3


def whole_model_fits(result: CaptureResult, device: DeviceSpec, training: TrainingConfig,
                     progress: Progress | None = None) -> Callable[[int], bool]:
    """`fits(b)`: whether the whole model trains at batch b (forward, backward, no optimizer
    step) in the usable memory of one `device`, by the memory model (module docstring)."""
    budget = usable_memory(device.memory_bytes, training)
    graph = result.graph
    outputs = [t for node in graph.nodes if not node.is_view for t in node.outputs]
    inputs = list(graph.inputs)
    held = sum(p.nbytes for p in graph.params)  # parameters, buffers and constants
    # one stage, one micro-batch, no optimizer state: the profile's forward and backward
    config = replace(training, optimizer="sgd", activation_checkpointing=False, sharding="none",
                     shards=1)
    table: list[CostTable] = []  # the roofline's table, priced on first need

    def upper_bound(b: int) -> int:
        return (_PARAMETER_FACTOR * held
                + _OUTPUT_FACTOR * sum(t.nbytes_at(b, graph.batch_size) for t in outputs)
                + sum(t.nbytes_at(b, graph.batch_size) for t in inputs))

    def fits(b: int) -> bool:
        if upper_bound(b) <= budget:
            return True
        if not table:
            table.append(plan_costs(result, device, progress=progress,
                                    precision=training.precision))
        peak = stage_memory(table[0], [n.name for n in graph.nodes], microbatch_size=b,
                            num_microbatches=1, stage_index=0, num_stages=1, config=config)
        return peak.total - peak.optimizer_state <= budget

    return fits
