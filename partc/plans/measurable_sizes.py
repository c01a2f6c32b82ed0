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
from pathlib import Path
from typing import Callable

from partc.cost.measured import (
    MeasuringOutOfMemory,
    ProfileOptions,
    parse_device,
    profile_model,
)
from partc.cost.plan_costs import plan_costs
from partc.cost.table import CostTable
from partc.frontend.capture import CaptureResult
from partc.graph.module_summary import human_bytes
from partc.hardware.local import measuring_device
from partc.hardware.specs import DeviceSpec
from partc.options import TrainingConfig
from partc.progress import Progress
from partc.solve.memory import stage_memory, usable_memory

# The cheap bound's factors: parameters held as weights, gradients, a bf16 copy and room to
# spare; operator outputs as saved activations, the backward's gradients of them and slack for
# what kernels keep besides their outputs (attention's math path, dropout's masks).
_PARAMETER_FACTOR = 4
_OUTPUT_FACTOR = 3


class WholeModelMemory:
    """What the whole model needs to train at a batch size (forward, backward, no optimizer
    step) against the usable memory of one `device`, by the memory model (module docstring)."""

    def __init__(self, result: CaptureResult, device: DeviceSpec, training: TrainingConfig,
                 progress: Progress | None = None) -> None:
        self.result, self.device = result, device
        self.budget = usable_memory(device.memory_bytes, training)
        graph = result.graph
        self._outputs = [t for node in graph.nodes if not node.is_view for t in node.outputs]
        self._held = sum(p.nbytes for p in graph.params)  # parameters, buffers and constants
        # one stage, one micro-batch, no optimizer state: the profile's forward and backward
        self._config = replace(training, optimizer="sgd", activation_checkpointing=False,
                               sharding="none", shards=1)
        self._table: CostTable | None = None  # the roofline's table, priced on first need
        self._progress = progress or Progress()
        self._needed: dict[int, int] = {}  # asked again by the halving, messages, re-searches

    def upper_bound(self, b: int) -> int:
        """The cheap bound from the graph alone: parameters and operator outputs, with room."""
        graph = self.result.graph
        return (_PARAMETER_FACTOR * self._held
                + _OUTPUT_FACTOR * sum(t.nbytes_at(b, graph.batch_size) for t in self._outputs)
                + sum(t.nbytes_at(b, graph.batch_size) for t in graph.inputs))

    def needed(self, b: int) -> int:
        """The memory model's bytes for the whole model at batch b (optimizer state left out)."""
        if b not in self._needed:
            # its own step: the roofline's table here only sizes the profile, and a "pricing by
            # the roofline" line would read as the model being priced by it
            with self._progress.step(f"checking the whole model against one "
                                     f"{self.device.name}'s memory at batch {b}"):
                if self._table is None:
                    self._table = plan_costs(self.result, self.device,
                                             precision=self._config.precision)
                graph = self.result.graph
                peak = stage_memory(self._table, [n.name for n in graph.nodes],
                                    microbatch_size=b, num_microbatches=1, stage_index=0,
                                    num_stages=1, config=self._config)
            self._needed[b] = peak.total - peak.optimizer_state
        return self._needed[b]

    def fits(self, b: int) -> bool:
        """Whether the whole model trains at batch b in the usable memory."""
        return self.upper_bound(b) <= self.budget or self.needed(b) <= self.budget


def whole_model_fits(result: CaptureResult, device: DeviceSpec, training: TrainingConfig,
                     progress: Progress | None = None) -> Callable[[int], bool]:
    """`fits(b)`: whether the whole model trains at batch b (forward, backward, no optimizer
    step) in the usable memory of one `device` (`WholeModelMemory.fits`)."""
    return WholeModelMemory(result, device, training, progress).fits


def check_profile_sizes(result: CaptureResult, device: DeviceSpec, training: TrainingConfig,
                        sizes: tuple[int, ...], progress: Progress | None = None) -> None:
    """Refuse, before measuring, a profile at batch sizes the whole model does not fit one
    `device` at: on a CPU the attempt would end in the OOM killer, which no handler sees."""
    memory = WholeModelMemory(result, device, training, progress)
    asked = sorted(set(sizes))
    too_large = [b for b in asked if not memory.fits(b)]
    if not too_large:
        return
    b = too_large[0]
    fitting = [s for s in asked if s not in too_large]
    if len(fitting) < 2:  # two sizes that fit: the largest halving of b that does and its half
        largest = next((s for s in _halvings(b) if memory.fits(s)), 1)
        fitting = [largest // 2, largest] if largest >= 2 else []
    raise MeasuringOutOfMemory(
        f"the whole model does not fit one {device.name}'s memory to be measured at batch "
        f"{', '.join(map(str, too_large))}: {human_bytes(memory.needed(b))} at batch {b} "
        f"against {human_bytes(memory.budget)} usable",
        hint=(f"measure sizes that fit (--batch-sizes {','.join(map(str, fitting))})"
              if fitting else "measure a smaller model")
        + ", or price it without measuring (--analytic DEVICE)")


def _halvings(b: int) -> list[int]:
    out = []
    while b > 1:
        b //= 2
        out.append(b)
    return out


def profile_within_memory(model_path: str | Path, batch_size: int, options: ProfileOptions,
                          progress: Progress | None = None) -> CostTable:
    """`partc profile`: the measured CostTable of the model (partc.cost.measured.profile_model),
    its sizes first checked against the measuring device's memory (`check_profile_sizes`; on a
    CPU the device is the RAM shared with the busy neighbours, which train the model too)."""
    training = TrainingConfig(precision=options.precision)

    def check(result: CaptureResult, sizes: tuple[int, ...]) -> None:
        # after profile_model has refused a device this machine lacks
        device = measuring_device(parse_device(options.device), options.neighbours + 1)
        if device is not None:  # a GPU no config matches: CUDA's own error is caught later
            check_profile_sizes(result, device, training, sizes, progress)

    return profile_model(model_path, batch_size, options, progress, check_sizes=check)
