"""Saved activations: the bytes each OpGraph node keeps for backward, measured in torch.

`torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd keeps for backward while
each node of the captured program runs (node by node, under partc.cost.torch_profiler's
interpreter). Each distinct storage is counted once, on the first node that saves it; parameters
and buffers are not activations and are left out. This runs on the meta device too (storages have
sizes but no data), so it needs no hardware and works for models of any size; `saved_activations`
fits the bytes of the captured B and 2B as a `Linear` of the micro-batch size.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.fx

from partc.cost.table import Linear
from partc.cost.torch_profiler import NodeRunner, flat_inputs, node_owner, program_module
from partc.frontend.export import Capture, quiet_torch
from partc.frontend.model_file import Inputs, inputs_to_meta


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Measurements run forward in training mode, which updates buffers in place (batch-norm
    statistics); those are the model's own state, which later passes (emit) save: put them back."""
    before = {n: t.detach().clone() for n, t in module.named_buffers() if not t.is_meta}
    try:
        yield
    finally:
        with torch.no_grad():
            for n, t in module.named_buffers():
                if n in before:
                    t.copy_(before[n])


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def saved_activation_bytes(module: torch.fx.GraphModule, inputs: Inputs) -> dict[str, int]:
    """Bytes each node saves for backward in one training forward pass (see the module docstring).
    Works with meta tensors. Nodes that save nothing are absent."""
    owner = node_owner(module)
    state = {_storage_key(t) for t in [*module.parameters(), *module.buffers()]}
    seen: set[int] = set(state)
    keep: list[torch.Tensor] = []  # saved storages stay alive, so keys cannot be reused
    current: list[str] = [""]
    saved: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            keep.append(t)
            name = owner.get(current[0], current[0])
            saved[name] = saved.get(name, 0) + t.untyped_storage().nbytes()
        return t

    @contextlib.contextmanager
    def around(n: torch.fx.Node) -> Iterator[None]:
        current[0] = n.name
        yield

    flat = flat_inputs(module, inputs)
    with (torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          quiet_torch()):
        NodeRunner(module, around).run(*flat)
    return saved


def saved_activations(capture: Capture) -> dict[str, Linear]:
    """Bytes each node saves for backward, fitted over the captured B and 2B. Runs on the meta
    device when the model is on meta (no memory, no device needed), else where the model lives."""
    points: dict[str, list[tuple[float, float]]] = {}
    programs = [(capture.batch_size, capture.exported)]
    if capture.scaled is not None:
        programs.append((capture.scaled_batch_size, capture.scaled))
    for b, program in programs:
        module = program_module(program)
        inputs = capture.model_file.inputs(b)
        if capture.on_meta:
            inputs = inputs_to_meta(inputs)
        with buffers_restored(module):
            saved = saved_activation_bytes(module, inputs)
        for name in {n.name for n in program.graph.nodes} | set(saved):
            points.setdefault(name, []).append((float(b), float(saved.get(name, 0))))
        del module
    return {name: Linear.fit(p) for name, p in points.items() if any(v for _, v in p)}


