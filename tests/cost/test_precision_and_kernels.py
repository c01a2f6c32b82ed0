"""Precision-aware analytic costs (autocast's dtypes per operator) and kernel-aware saved
activations (attention counted as the target device's fused kernels keep it)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from partc.cost.activations import attention_kernel, saved_activation_bytes, saved_activations
from partc.cost.autocast import autocast_dtypes
from partc.cost.roofline import analytic_cost_table
from partc.cost.torch_profiler import program_module
from partc.frontend.export import export_program
from partc.frontend.model_file import inputs_to_meta
from partc.hardware.configs import load_device


def _total(table, m: float) -> float:  # type: ignore[no-untyped-def]
    return table.total_forward_s(m) + table.total_backward_s(m)


def _device_with_bf16(name: str, over_fp32: float):  # type: ignore[no-untyped-def]
    """The shipped device `name` with its bfloat16 peak set to `over_fp32` x its float32 one: the
    shipped cpu config is whichever machine calibrated it last (bf16 autocast ran 2.8x faster
    than fp32 on the AMD VM, 2x slower on the Intel one), and these tests check how the model
    uses a dtype's peak, not that machine."""
    device = load_device(name)
    peaks = {**device.peak_flops, "bfloat16": over_fp32 * device.peak_flops["float32"]}
    return dataclasses.replace(device, peak_flops=peaks)


def test_autocast_dtypes_follow_torch_autocast_rules(capture_example) -> None:
    graph = capture_example("bert").graph
    dtypes = autocast_dtypes(graph, "bf16-mixed")
    kinds = {n.kind: n for n in graph.nodes}
    linear, norm = kinds["linear"], kinds["layer_norm"]
    assert dtypes.tensors[linear.outputs[0].name] == "bfloat16"
    assert dtypes.nodes[linear.name].compute_dtype == "bfloat16"
    # a Linear reads fp32 weights and activations: autocast converts them in front of it
    assert dtypes.nodes[linear.name].cast_kernels >= 1 and dtypes.nodes[linear.name].cast_bytes > 0
    assert dtypes.tensors[norm.outputs[0].name] == "float32"
    # the residual add of a bf16 projection and the fp32 stream promotes to fp32
    adds = [n for n in graph.nodes if n.kind == "add"
            and {dtypes.tensors.get(t) for t in n.inputs} == {"bfloat16", "float32"}]
    assert adds and all(dtypes.tensors[a.outputs[0].name] == "float32" for a in adds)
    # integer tensors (token ids, masks) never change
    ints = [t for t in graph.inputs if t.dtype == "int64"]
    assert ints and all(dtypes.tensors[t.name] == "int64" for t in ints)
    plain = autocast_dtypes(graph, "fp32")
    assert all(c.scale == 1.0 and c.cast_bytes == 0 for c in plain.nodes.values())


@pytest.mark.parametrize("device_name", ["h100-80gb", "cpu"])
def test_bf16_mixed_and_fp32_are_priced_differently(capture_example, device_name: str) -> None:
    graph = capture_example("gpt2").graph
    big = 4096  # matrix ops run at the bfloat16 peak, elementwise ones move half the bytes
    shipped = load_device(device_name)
    fp32 = analytic_cost_table(graph, shipped, precision="fp32")
    bf16 = analytic_cost_table(graph, shipped, precision="bf16-mixed")
    assert fp32.source.precision == "fp32" and bf16.source.precision == "bf16-mixed"
    assert _total(bf16, big) != pytest.approx(_total(fp32, big), rel=0.05)
    # where bf16 matrix units are faster (a GPU; most CPUs with bf16 instructions), bf16 is
    # cheaper; where they are slower, dearer
    for over, cheaper in ((4.0, True), (0.5, False)):
        device = _device_with_bf16(device_name, over)
        fp32 = analytic_cost_table(graph, device, precision="fp32")
        bf16 = analytic_cost_table(graph, device, precision="bf16-mixed")
        assert (_total(bf16, big) < _total(fp32, big)) == cheaper, over


def test_compute_bound_matmul_runs_at_the_bfloat16_peak(capture_example) -> None:
    graph = capture_example("mlp").graph
    # 256-wide Linears, compute-bound in both dtypes on a CPU with this much memory bandwidth
    device = _device_with_bf16("cpu", 2.5)
    device = dataclasses.replace(device, memory_bandwidth=200e9)
    fp32 = analytic_cost_table(graph, device, precision="fp32")
    bf16 = analytic_cost_table(graph, device, precision="bf16-mixed")
    linear = next(n for n in graph.nodes if n.kind == "linear")
    ratio = device.peak_flops["bfloat16"] / device.peak_flops["float32"]
    m = 1 << 16
    # bf16 adds the conversion of the fp32 input in front of the Linear (autocast): bounded
    assert fp32.forward_s(linear.name, m) / bf16.forward_s(linear.name, m) == pytest.approx(
        ratio, rel=0.25)
    assert fp32.forward_s(linear.name, m) > bf16.forward_s(linear.name, m)


def test_gpu_host_overhead_bounds_small_shapes(capture_example) -> None:
    """On a GPU the host's dispatch overlaps kernels: a launch-bound model costs about one host
    dispatch per operator and pass, whatever the micro-batch."""
    graph = capture_example("bert").graph
    device = load_device("h100-80gb")
    table = analytic_cost_table(graph, device)
    kernels = [n for n in graph.nodes if not n.is_view and table.cost(n.name).method != "none"]
    assert table.total_forward_s(1) == pytest.approx(len(kernels) * device.op_overhead_s,
                                                     rel=0.05)
    slower = dataclasses.replace(device, op_overhead_s=2 * device.op_overhead_s)
    assert analytic_cost_table(graph, slower).total_forward_s(1) == pytest.approx(
        2 * table.total_forward_s(1), rel=0.05)


class _Attention(torch.nn.Module):
    def __init__(self, dropout: float, mask: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 3 * 64)
        self.dropout = dropout
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() if self.mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout)


@pytest.mark.parametrize("dropout,mask", [(0.0, False), (0.0, True), (0.1, False)])
def test_saved_attention_counts_the_target_kernel(dropout: float, mask: bool) -> None:
    b, s = 2, 256
    model = _Attention(dropout, mask).train()
    x = torch.randn(b, s, 64)
    module = program_module(export_program(model, ((x,), {}), "test"))
    probs = b * 4 * s * s * 4  # the math path's softmax output, fp32
    real_cpu = sum(saved_activation_bytes(module, ((x,), {})).values())
    with torch.device("meta"):
        meta_model = _Attention(dropout, mask).train()
    meta_x = inputs_to_meta(((x,), {}))
    meta_module = program_module(export_program(meta_model, meta_x, "test"))
    on_meta = sum(saved_activation_bytes(meta_module, meta_x).values())
    for_cpu = sum(saved_activation_bytes(meta_module, meta_x, target_kind="cpu").values())
    for_cuda = sum(saved_activation_bytes(meta_module, meta_x, target_kind="cuda").values())
    assert on_meta >= probs  # meta runs the math path
    # counted for a CPU target on meta == what the CPU itself saves
    assert for_cpu == real_cpu
    # CUDA's fused kernels keep O(b*h*s): far less than the probabilities
    assert for_cuda < on_meta - probs // 2
    # and a real CPU pricing a CUDA plan counts the same as meta does
    cuda_from_cpu = sum(saved_activation_bytes(module, ((x,), {}), target_kind="cuda").values())
    assert cuda_from_cpu == for_cuda
    cpu_kernel = attention_kernel("cpu", torch.zeros(1, 4, s, 16), torch.zeros(1, 4, s, 16),
                                  None, dropout, False, False)
    assert cpu_kernel == ("math" if dropout else "flash_cpu")


def test_meta_model_saved_activations_for_cuda_are_smaller(capture_example) -> None:
    capture = capture_example("bert").capture
    math = saved_activations(capture)
    cuda = saved_activations(capture, target_kind="cuda")
    assert sum(v.at(16) for v in cuda.values()) < sum(v.at(16) for v in math.values())
