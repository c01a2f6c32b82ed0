"""Precision-aware analytic costs (autocast's dtypes per operator) and kernel-aware saved
activations (attention counted as the target device's fused kernels keep it)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from partc.cost.activations import (
    attention_kernel,
    buffers_restored,
    on_meta,
    saved_activation_bytes,
    saved_activations,
)
from partc.cost.autocast import (
    CPU_FLOAT32_KINDS,
    FLOAT32_KINDS,
    LOWER_PRECISION_KINDS,
    autocast_dtypes,
)
from partc.cost.roofline import analytic_cost_table
from partc.cost.table import Linear
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


@pytest.mark.parametrize("device_kind", ["cuda", "cpu"])
def test_autocast_dtypes_follow_torch_autocast_rules(capture_example, device_kind: str) -> None:
    graph = capture_example("bert").graph
    dtypes = autocast_dtypes(graph, "bf16-mixed", device_kind)
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
    plain = autocast_dtypes(graph, "fp32", device_kind)
    assert all(c.scale == 1.0 and c.cast_bytes == 0 for c in plain.nodes.values())


def test_cpu_float32_kinds_are_torchs(capture_example) -> None:
    """The CPU's float32 list is the ops torch's AutocastCPU key casts up, read from the
    dispatcher (every op with an AutocastCPU kernel that is neither a lower-precision op nor one
    that promotes); on a CPU a pow, a norm or a softmax of a bfloat16 tensor stays bfloat16,
    where CUDA's autocast computes it in float32. HF GPT-2's GELU (x ** 3 of a bfloat16
    projection) priced in float32 on a CPU put its stage 3 MiB above the measured peak."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    cast = {name.split(".")[0].removeprefix("aten::")
            for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and has(name, "AutocastCPU")}
    promoting = {"cat", "stack", "index_copy"}
    lower = LOWER_PRECISION_KINDS | {"_addmm_activation", "mkldnn_rnn_layer"}
    assert cast - lower - promoting <= CPU_FLOAT32_KINDS
    # composites whose inner op is cast (cross_entropy -> cross_entropy_loss) and the forms
    # export decomposes losses into are listed besides
    assert CPU_FLOAT32_KINDS - cast <= {"cross_entropy", "nll_loss_forward",
                                        "nll_loss2d_forward"}
    x = torch.rand(4, 8, dtype=torch.bfloat16) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = {"pow": torch.pow(x, 3.0), "layer_norm": F.layer_norm(x, (8,)),
                "softmax": torch.softmax(x, -1), "exp": torch.exp(x), "sum": x.sum(-1)}
        raised = {"mse_loss": F.mse_loss(x, x), "prod": x.prod(-1)}
    assert {k: str(v.dtype) for k, v in kept.items()} == dict.fromkeys(kept, "torch.bfloat16")
    assert {k: str(v.dtype) for k, v in raised.items()} == dict.fromkeys(raised, "torch.float32")
    assert set(kept) <= FLOAT32_KINDS and not set(kept) & CPU_FLOAT32_KINDS
    assert set(raised) <= CPU_FLOAT32_KINDS

    graph = capture_example("gpt2").graph
    pow_node = next(n for n in graph.nodes if n.kind == "pow")
    on_cpu = autocast_dtypes(graph, "bf16-mixed", "cpu")
    on_cuda = autocast_dtypes(graph, "bf16-mixed", "cuda")
    assert on_cpu.tensors[pow_node.outputs[0].name] == "bfloat16"
    assert on_cuda.tensors[pow_node.outputs[0].name] == "float32"


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
    """Self-attention as HF models write it: heads are views of one projection, and the output
    goes back to one row per token (transpose + reshape) into an output projection."""

    def __init__(self, dropout: float, mask: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 3 * 64)
        self.out = torch.nn.Linear(64, 64)
        self.dropout = dropout
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() if self.mask else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout)
        return self.out(o.transpose(1, 2).reshape(b, s, 64))


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
    # counted for a CPU target on meta == what the CPU itself saves (its flash kernel's output
    # follows the query's layout, so the output projection saves a view of it, not a copy)
    assert for_cpu == real_cpu
    # CUDA's fused kernels keep O(b*h*s): far less than the probabilities
    assert for_cuda < on_meta - probs // 2
    # and a real CPU pricing a CUDA plan counts the same as meta does
    cuda_from_cpu = sum(saved_activation_bytes(module, ((x,), {}), target_kind="cuda").values())
    assert cuda_from_cpu == for_cuda
    cpu_kernel = attention_kernel("cpu", torch.zeros(1, 4, s, 16), torch.zeros(1, 4, s, 16),
                                  None, dropout, False, False)
    assert cpu_kernel == ("math" if dropout else "flash_cpu")
    # a learned additive mask (it needs a gradient) keeps the CPU on the math path, as torch's
    # dispatcher does (the flash kernel has no mask gradient); a constant mask does not
    learned = torch.zeros(1, 4, s, s, requires_grad=True)
    assert attention_kernel("cpu", torch.zeros(1, 4, s, 16), torch.zeros(1, 4, s, 16), learned,
                            0.0, False, False) == "math"
    assert attention_kernel("cpu", torch.zeros(1, 4, s, 16), torch.zeros(1, 4, s, 16),
                            learned.detach(), 0.0, False, False) == "flash_cpu"
    # CUDA's efficient kernel lays its output out as (batch, sequence, heads, dim): the output
    # projection's input is a view of what the attention saved, nothing of its own; meta's math
    # path output is (batch, heads, sequence, dim), and the reshape copies it
    per_node = saved_activation_bytes(meta_module, meta_x, target_kind="cuda")
    projections = sorted(n for n in saved_activation_bytes(meta_module, meta_x)
                         if n.startswith("linear"))
    assert projections == ["linear", "linear_1"]
    assert per_node.get("linear_1", 0) == 0
    assert saved_activation_bytes(meta_module, meta_x)["linear_1"] == b * s * 64 * 4


class _Dropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(self.a(x), 0.1, training=True))


def test_dropout_is_saved_as_the_target_kernel_keeps_it() -> None:
    """A CPU's dropout multiplies by a float noise tensor and keeps it; CUDA runs it fused
    (native_dropout) and keeps a bool mask: a quarter of the bytes in float32."""
    x = torch.randn(8, 32)
    module = program_module(export_program(_Dropout().train(), ((x,), {}), "test"))
    [node] = [n.name for n in module.graph.nodes if n.target is torch.ops.aten.dropout.default]
    numel = 8 * 32
    real_cpu = saved_activation_bytes(module, ((x,), {}))
    assert real_cpu[node] == numel * 4  # float32 noise: what the CPU itself keeps
    assert saved_activation_bytes(module, ((x,), {}), target_kind="cpu")[node] == numel * 4
    assert saved_activation_bytes(module, ((x,), {}), target_kind="cuda")[node] == numel
    with torch.device("meta"):
        meta_model = _Dropout().train()
    meta_x = inputs_to_meta(((x,), {}))
    meta_module = program_module(export_program(meta_model, meta_x, "test"))
    assert saved_activation_bytes(meta_module, meta_x, target_kind="cuda")[node] == numel


def test_dropout_saved_bytes_scale_under_autocast_only_where_they_are_noise(
        capture_example) -> None:
    """Under bf16-mixed a CPU's dropout noise takes its input's dtype (bfloat16 after a matrix
    op) while CUDA's bool mask keeps its size."""
    capture = capture_example("bert")
    graph = capture.graph
    dropouts = [n.name for n in graph.nodes if n.kind == "dropout"]
    assert dropouts
    for kind, name in (("cpu", "cpu"), ("cuda", "h100-80gb")):
        device = load_device(name)
        saved = saved_activations(capture.capture, target_kind=kind)
        fp32 = analytic_cost_table(graph, device, saved=saved)
        bf16 = analytic_cost_table(graph, device, saved=saved, precision="bf16-mixed")
        ratios = {bf16.cost(n).saved.at(4) / fp32.cost(n).saved.at(4) for n in dropouts
                  if fp32.cost(n).saved.at(4)}
        if kind == "cuda":
            assert ratios == {1.0}
        else:  # bfloat16 inputs (after a projection) halve; float32 ones (after a norm) do not
            assert 0.5 in ratios and ratios <= {0.5, 1.0}


def test_meta_model_saved_activations_for_cuda_are_smaller(capture_example) -> None:
    capture = capture_example("bert").capture
    math = saved_activations(capture)
    cuda = saved_activations(capture, target_kind="cuda")
    assert sum(v.at(16) for v in cuda.bytes.values()) < sum(v.at(16) for v in math.bytes.values())


@pytest.mark.parametrize("example", ["transformer", "bert", "resnet"])
def test_saved_activations_of_a_real_model_are_counted_on_a_meta_copy(capture_example,
                                                                       example: str) -> None:
    """A model with real weights is counted on meta copies of its weights and inputs (no
    activation is held here, whatever the model's size), and gives what running it here gives,
    for either target; the program keeps its own weights."""
    capture = capture_example(example).capture
    assert not capture.on_meta
    weights = {n: t.clone() for n, t in capture.exported.state_dict.items()}
    for kind in ("cpu", "cuda"):
        here: dict[str, list[tuple[float, float]]] = {}
        for b, program in [(capture.batch_size, capture.exported),
                           (capture.scaled_batch_size, capture.scaled)]:
            module = program_module(program)
            with buffers_restored(module):
                for name, v in saved_activation_bytes(
                        module, capture.model_file.inputs(b), kind).items():
                    here.setdefault(name, []).append((float(b), float(v)))
        counted = saved_activations(capture, target_kind=kind)
        assert {n: (c.at(3), c.at(5)) for n, c in counted.bytes.items()} == \
            {n: (Linear.fit(p).at(3), Linear.fit(p).at(5)) for n, p in here.items()}
    for name, t in capture.exported.state_dict.items():
        assert not t.is_meta and torch.equal(t, weights[name])


def test_a_program_meta_cannot_run_is_counted_where_it_lives() -> None:
    """`.item()` has no meta kernel: the count falls back to running the program here."""
    from partc.frontend.capture import capture_graph

    capture = capture_graph("tests/models/counts_on_values.py", 2, onnx=False).capture
    module = program_module(capture.exported)
    inputs = capture.model_file.inputs(capture.batch_size)
    with pytest.raises(Exception):  # noqa: B017 - which error meta raises is torch's business
        saved_activation_bytes(on_meta(program_module(capture.exported)),
                               inputs_to_meta(inputs), "cpu")
    here = saved_activation_bytes(module, inputs, "cpu")
    counted = saved_activations(capture, target_kind="cpu")
    assert here and {n: c.at(capture.batch_size) for n, c in counted.bytes.items()} == \
        {n: float(v) for n, v in here.items()}
