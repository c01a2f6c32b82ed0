"""CostTable: measured (real onnxruntime + torch profiling on this CPU) and analytic costs."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml
from conftest import EXAMPLES, TEST_MODELS

from partc.cost.activations import saved_activation_bytes, saved_activations
from partc.cost.measured import ProfileOptions, profile_model
from partc.cost.op_classes import op_class
from partc.cost.roofline import analytic_cost_table, roofline_s
from partc.cost.table import CostTable, Curve, Linear, ProfileFileError, needs_backward
from partc.cost.torch_profiler import program_module
from partc.frontend.capture import capture_graph
from partc.frontend.export import export_program
from partc.frontend.model_file import inputs_to_meta
from partc.hardware.configs import load_device
from partc.hardware.local import cpu_vector_bytes

FAST = ProfileOptions(runs=3, warmup=1, totals_budget_s=0.2)  # (totals: 0.2 s, not 1 s)


def test_linear_fit() -> None:
    assert Linear.fit([(2, 3.0), (4, 5.0)]) == Linear(1.0, 1.0)
    exact = Linear.fit([(1, 2.0), (2, 4.0), (4, 8.0)])
    assert exact.fixed == pytest.approx(0.0, abs=1e-12) and exact.per_sample == pytest.approx(2.0)
    # noise that would make costs fall with the batch: constant instead
    assert Linear.fit([(2, 5.0), (4, 4.0)]) == Linear(4.5, 0.0)
    # negative intercept: a line through the origin, never a negative cost at small batches
    through = Linear.fit([(2, 1.0), (4, 3.0)])
    assert through.fixed == 0.0 and through.at(0) == 0.0 and through.per_sample > 0
    assert Linear(1.0, 2.0).at(3) == 7.0 and Linear(-5.0, 1.0).at(1) == 0.0


def test_curve_is_exact_at_its_points_and_linear_between_and_beyond() -> None:
    c = Curve.through([(64, 10.0), (2, 1.0), (512, 100.0)])
    assert c.points == ((2.0, 1.0), (64.0, 10.0), (512.0, 100.0))
    assert [c.at(m) for m in (2, 64, 512)] == [1.0, 10.0, 100.0]
    assert c.at(33) == pytest.approx(5.5)  # halfway between 2 and 64
    assert c.at(1024) == pytest.approx(100.0 + 90.0 / 448 * 512)  # the last segment continued
    assert c.at(0) == pytest.approx(1.0 - 9.0 / 62 * 2)  # the first segment continued
    assert Curve.through([(2, 1.0), (4, 10.0)]).at(0) == 0.0  # ... never below 0
    assert Curve.line(1.0, 2.0).at(3) == 7.0 and Curve(((4.0, 8.0),)).at(2) == 4.0
    assert Curve(()).at(5) == 0.0
    with pytest.raises(ValueError):
        Curve.through([(2, 1.0), (2, 2.0)])
    # measured: repeats are medians, a value below a smaller size's is noise and raised to it
    assert Curve.measured([(4, 3.0), (2, 5.0), (2, 1.0), (2, 2.0)]).points == ((2.0, 2.0),
                                                                                 (4.0, 3.0))
    assert Curve.measured([(2, 5.0), (4, 4.0)]).points == ((2.0, 5.0), (4.0, 5.0))
    # sums are exact everywhere, also between and beyond the points of either
    a, b = Curve.through([(2, 1.0), (8, 4.0)]), Curve.line(0.5, 0.25)
    total = Curve.total([a, b])
    for m in (0, 1, 2, 3.5, 8, 100):
        assert total.at(m) == pytest.approx(a.at(m) + b.at(m))
    assert Curve.through([(2, 1.0), (4, 3.0)]).scaled(2.0).at(3) == pytest.approx(4.0)


def test_op_classes() -> None:
    assert op_class("linear") == "matmul"
    assert op_class("conv2d") == "conv"
    assert op_class("scaled_dot_product_attention") == "attention"
    assert op_class("layer_norm") == "norm"
    assert op_class("gelu") == "elementwise"
    assert op_class("embedding") == "gather"


class _TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * 2.0


def test_saved_bytes_are_exactly_what_autograd_keeps() -> None:
    model = _TwoLayer()
    x = torch.randn(5, 4)
    program = torch.export.export(model, (x,))
    saved = saved_activation_bytes(program_module(program), ((x,), {}))
    # linear saves its input x (weights are parameters, not activations); relu saves its output;
    # the multiplication by a constant saves nothing.
    assert saved == {"linear": 5 * 4 * 4, "relu": 5 * 8 * 4}


def test_saved_bytes_on_meta_match_cpu_for_a_plain_model() -> None:
    result = capture_graph(EXAMPLES / "mlp.py", 2, onnx=False)
    on_cpu = saved_activations(result.capture)
    # the same model built on meta: only shapes, the same bytes
    model_file = result.capture.model_file
    meta_inputs = inputs_to_meta(model_file.inputs(2))
    program = export_program(model_file.build().to("meta"), meta_inputs, "mlp on meta")
    keepers: set[str] = set()
    on_meta = saved_activation_bytes(program_module(program), meta_inputs, keeps_result=keepers)
    assert on_meta and {n: int(c.at(2)) for n, c in on_cpu.bytes.items()} == on_meta
    # the ReLUs keep their outputs (the Linears their inputs, which are those same outputs: the
    # storage counts once, on the ReLU that kept it first)
    relus = {n.name for n in result.graph.nodes if n.kind == "relu"}
    assert relus and keepers == relus == on_cpu.keeps_result


@pytest.fixture(scope="module")
def mlp_profile() -> CostTable:
    return profile_model(EXAMPLES / "mlp.py", 2, FAST)


def test_profile_prices_every_node_and_round_trips(mlp_profile: CostTable, tmp_path: Path) -> None:
    table = mlp_profile
    src = table.source
    assert src.kind == "measured" and src.provider == "CPUExecutionProvider"
    assert src.batch_sizes == (2, 4) and src.threads == 1
    assert src.versions["torch"].startswith("2.13") and "onnxruntime" in src.versions
    assert src.graph_hash == table.graph.content_hash()
    linears = [n.name for n in table.graph.nodes if n.kind == "linear"]
    assert len(linears) == 6
    for name in linears:
        cost = table.cost(name)
        assert cost.method == "onnxruntime"
        assert cost.forward.at(4) > 0 and cost.backward.at(4) > 0
    # the first linear saves the input; later ones' inputs are the ReLU outputs, which the ReLU
    # saved first (each storage counts once, on its first saver)
    assert table.saved_bytes(linears[0], 4) == 4 * 64 * 4
    assert table.total_saved_bytes(4) == pytest.approx(2 * table.total_saved_bytes(2))
    path = table.save(tmp_path / "profile.yaml")
    text = path.read_text()
    assert yaml.safe_load(text)["format"] == "partc-profile"
    loaded = CostTable.load(path, table.graph)
    assert loaded.source == table.source
    assert loaded.nodes.keys() == table.nodes.keys()
    # which nodes keep their own result (the ReLUs) is measured and written with the profile
    relus = {n.name for n in table.graph.nodes if n.kind == "relu"}
    assert relus and table.keeps_result == loaded.keeps_result == relus
    # the SIMD width of the CPU that measured it (what its kernels block tensors by)
    assert table.cpu_vector_bytes == loaded.cpu_vector_bytes == cpu_vector_bytes()
    for name, cost in table.nodes.items():
        assert loaded.nodes[name].forward.at(3) == pytest.approx(cost.forward.at(3), rel=1e-9)
        assert loaded.nodes[name].saved.at(3) == pytest.approx(cost.saved.at(3), rel=1e-9)
    assert loaded.save(tmp_path / "again.yaml").read_text() == text


def test_profile_applies_to_the_same_model_at_another_batch(mlp_profile: CostTable,
                                                            tmp_path: Path) -> None:
    path = mlp_profile.save(tmp_path / "profile.yaml")
    other_batch = capture_graph(EXAMPLES / "mlp.py", 8, onnx=False).graph
    assert CostTable.load(path, other_batch).total_forward_s(8) > 0


def test_profile_of_another_model_is_refused(mlp_profile: CostTable, tmp_path: Path) -> None:
    path = mlp_profile.save(tmp_path / "profile.yaml")
    other = capture_graph(EXAMPLES / "transformer.py", 2, onnx=False).graph
    with pytest.raises(ProfileFileError, match="different model"):
        CostTable.load(path, other)
    with pytest.raises(ProfileFileError, match="not found"):
        CostTable.load(tmp_path / "missing.yaml", other)
    (tmp_path / "bad.yaml").write_text("format: something-else\n")
    with pytest.raises(ProfileFileError, match="not a partc profile"):
        CostTable.load(tmp_path / "bad.yaml", other)
    (tmp_path / "broken.yaml").write_text(path.read_text()[:200] + "\n  : [\n")
    with pytest.raises(ProfileFileError):
        CostTable.load(tmp_path / "broken.yaml", mlp_profile.graph)
    # a node priced at 1e300 s (finite): compile wrote a plan predicting 1e300 s per
    # iteration, which every command then refused to load
    text = path.read_text()
    first = next(line for line in text.splitlines() if line.startswith('  "'))
    name, row = first.split(": ", 1)
    absurd = yaml.safe_load(row)
    absurd[1] = [1e300] * len(absurd[1])
    (tmp_path / "absurd.yaml").write_text(text.replace(first, f"{name}: {json.dumps(absurd)}"))
    with pytest.raises(ProfileFileError, match="beyond any measurement's"):
        CostTable.load(tmp_path / "absurd.yaml", mlp_profile.graph)


def test_a_profiles_speed_spread_round_trips_and_is_checked(mlp_profile: CostTable,
                                                           tmp_path: Path) -> None:
    """A run's speed spread (compile --calibrate-from) is written with the costs and read back;
    a profile without one writes no key (older profiles' bytes unchanged), and an edited one
    whose modes are not a spread is refused as a malformed profile."""
    assert "speed_spread" not in mlp_profile.dumps()
    spread = dataclasses.replace(mlp_profile, speed_modes=((0.75, 1.0), (0.25, 1.5)))
    path = spread.save(tmp_path / "spread.yaml")
    loaded = CostTable.load(path, mlp_profile.graph)
    assert loaded.speed_modes == ((0.75, 1.0), (0.25, 1.5))  # a mean of 1.125: a run's may
    assert loaded.dumps() == path.read_text()
    for bad, why in (("[[0.5, 1.0]]", "summing to 0.5"), ("[[1.0, -1.0]]", "a factor > 0"),
                     ("[]", "non-empty")):
        text = path.read_text().replace("speed_spread:\n- - 0.75\n  - 1.0\n- - 0.25\n  - 1.5\n",
                                        f"speed_spread: {bad}\n")
        assert text != path.read_text()
        (tmp_path / "bad_spread.yaml").write_text(text)
        with pytest.raises(ProfileFileError, match=f"speed_spread .*{re.escape(why)}"):
            CostTable.load(tmp_path / "bad_spread.yaml", mlp_profile.graph)
    # and a run's optimizer step over its price, likewise
    stepped = dataclasses.replace(mlp_profile, optimizer_factor=1.3)
    path = stepped.save(tmp_path / "stepped.yaml")
    assert "optimizer_factor: 1.3\n" in path.read_text()
    assert CostTable.load(path, mlp_profile.graph).optimizer_factor == 1.3
    assert "optimizer_factor" not in mlp_profile.dumps()
    for bad in ("0", "-1.0", ".nan", "true", "fast"):
        (tmp_path / "bad_step.yaml").write_text(path.read_text().replace(
            "optimizer_factor: 1.3\n", f"optimizer_factor: {bad}\n"))
        with pytest.raises(ProfileFileError, match="optimizer_factor must be a number > 0"):
            CostTable.load(tmp_path / "bad_step.yaml", mlp_profile.graph)


def test_model_without_onnx_is_priced_in_torch() -> None:
    table = profile_model(TEST_MODELS / "qr_layer.py", 2, FAST)
    assert table.graph.onnx.status == "failed"
    assert set(table.methods()) <= {"torch", "none"} and table.methods()["torch"] >= 3
    qr = next(n for n in table.graph.nodes if n.kind == "linalg_qr")
    assert table.forward_s(qr.name, 4) > 0 and table.backward_s(qr.name, 4) > 0
    assert table.source.provider == ""


def test_meta_model_is_materialised_for_profiling() -> None:
    table = profile_model(TEST_MODELS / "tiny_gpt2_meta.py", 2, FAST)
    assert table.graph.on_meta
    assert table.methods().get("onnxruntime", 0) > 20
    assert table.total_backward_s(4) > 0 and table.total_saved_bytes(4) > table.total_saved_bytes(2)


def test_nodes_without_gradient_have_no_backward(capture_example) -> None:
    graph = capture_example("gpt2").graph
    table = analytic_cost_table(graph, load_device("a100-80gb"))
    grad = needs_backward(graph)
    # position ids / causal mask arithmetic depends on no parameter
    no_grad = [n for n in graph.nodes if n.name not in grad and not n.is_view]
    assert no_grad and all(table.backward_s(n.name, 8) == 0.0 for n in no_grad)
    assert all(table.backward_s(n.name, 8) > 0 for n in graph.nodes if n.kind == "linear")


@pytest.mark.parametrize("device_name", ["a100-80gb", "cpu"])
def test_roofline_is_compute_or_memory_bound(device_name: str) -> None:
    """max(compute, memory), with the host's dispatch added on a CPU and overlapped on a GPU."""
    device = load_device(device_name)
    graph = capture_graph(EXAMPLES / "mlp.py", 256, onnx=False).graph
    linear = next(n for n in graph.nodes if n.kind == "linear")
    relu = next(n for n in graph.nodes if n.kind == "relu")

    def with_host(work: float) -> float:
        if device.kind == "cuda":
            return max(work, device.op_overhead_s)
        return work + device.op_overhead_s

    t_linear = roofline_s(linear, graph, device, 256)
    compute = linear.flops / device.flops_per_s("float32", "matmul")
    memory = (linear.bytes_read + linear.bytes_written) / device.bytes_per_s()
    assert t_linear == pytest.approx(with_host(max(compute, memory)))
    t_relu = roofline_s(relu, graph, device, 256)
    assert t_relu == pytest.approx(with_host((relu.bytes_read + relu.bytes_written)
                                             / device.bytes_per_s()))
    views = [n for n in graph.nodes if n.is_view]
    assert all(roofline_s(n, graph, device, 256) == 0.0 for n in views)


@pytest.mark.parametrize("device_name", ["a100-80gb", "cpu"])
def test_analytic_line_is_the_rooflines_upper_envelope(device_name: str) -> None:
    """Never below the roofline at any micro-batch, and exact where one side dominates."""
    device = load_device(device_name)
    graph = capture_graph(EXAMPLES / "mlp.py", 2, onnx=False).graph
    table = analytic_cost_table(graph, device)
    priced = [n for n in graph.nodes if not n.is_view]
    for m in (1, 2, 7, 64, 512, 4096):
        for n in priced:
            assert table.forward_s(n.name, m) >= roofline_s(n, graph, device, m) * (1 - 1e-9)
    # far past the ridge point every Linear is compute-bound: the line's slope is the compute one
    linear = next(n for n in priced if n.kind == "linear")
    big = 1 << 20
    assert table.forward_s(linear.name, big) == pytest.approx(
        roofline_s(linear, graph, device, big), rel=0.01)


@pytest.mark.parametrize("name", ["mlp", "transformer", "bert", "gpt2", "resnet"])
def test_analytic_table_for_every_example(capture_example, name: str) -> None:
    result = capture_example(name)
    slow, fast = load_device("v100-32gb"), load_device("h100-80gb")
    saved = saved_activations(result.capture)
    a = analytic_cost_table(result.graph, slow, saved=saved)
    b = analytic_cost_table(result.graph, fast, saved=saved)
    assert a.source.kind == "analytic" and a.methods()["analytic"] > 0
    assert 0 < b.total_forward_s(8) < a.total_forward_s(8)
    assert a.total_forward_s(16) > a.total_forward_s(2)
    assert a.total_saved_bytes(4) == pytest.approx(2 * a.total_saved_bytes(2), rel=0.2)


# gpt2, resnet and bert in the slow set: the default run profiles the transformer here, BERT
# through the CLI on onnxruntime's path (tests/test_cli.py, the profile's output), the MLP and
# the ResNet through compile's measured costs
@pytest.mark.parametrize("name", ["transformer", pytest.param("bert", marks=pytest.mark.slow),
                                  pytest.param("gpt2", marks=pytest.mark.slow),
                                  pytest.param("resnet", marks=pytest.mark.slow)])
def test_profile_every_example_on_cpu(name: str, tmp_path: Path) -> None:
    # (mlp is profiled by the fixture above; the 1.3B meta example is priced analytically in the
    # slow tests: measuring it means materialising 1.3B parameters on this CPU.)
    table = profile_model(EXAMPLES / f"{name}.py", 2, FAST)
    methods = table.methods()
    assert methods.get("onnxruntime", 0) > methods.get("torch", 0)
    priced = [n for n in table.graph.nodes if table.cost(n.name).method != "none"]
    assert all(table.forward_s(n.name, 4) >= 0 for n in priced)
    assert table.total_backward_s(4) > 0 and table.total_saved_bytes(4) > 0
    loaded = CostTable.load(table.save(tmp_path / "p.yaml"), table.graph)
    assert loaded.total_forward_s(8) == pytest.approx(table.total_forward_s(8), rel=1e-9)


def test_combine_splits_torch_totals_by_onnxruntime_shares(capture_example) -> None:
    """The arithmetic of joining the measurements, on hand-made timings of a real graph."""
    from partc.cost.measured import _Measurement, combine
    from partc.cost.ort_profiler import OrtTiming
    from partc.cost.torch_profiler import LossCost, TorchTiming

    graph = capture_example("mlp").graph
    linears = [n.name for n in graph.nodes if n.kind == "linear"]
    relus = [n.name for n in graph.nodes if n.kind == "relu"]
    measurements = []
    for b in (2, 4):
        # torch: every linear 3 units fwd / 6 bwd, relu 1 / 1; ORT sees linears at 2 units each
        # and relus at 1; whole model fwd 10*b ms, bwd 20*b ms
        torch_t = TorchTiming(
            batch_size=b, model_forward_s=0.010 * b, model_backward_s=0.020 * b,
            node_forward_s={**{n: 3.0 for n in linears}, **{n: 1.0 for n in relus}},
            node_backward_s={**{n: 6.0 for n in linears}, **{n: 1.0 for n in relus}},
            unattributed_backward_s=0.0, differentiable=frozenset(linears + relus), runs=1)
        ort_t = OrtTiming(batch_size=b, provider="CPUExecutionProvider", model_run_s=0.0,
                          node_forward_s={**{n: 2.0 for n in linears}, **{n: 1.0 for n in relus}},
                          unmapped_s=0.0, runs=1)
        measurements.append(_Measurement(batch_size=b, torch=torch_t, ort=ort_t,
                                         saved={linears[0]: 100 * b},
                                         loss=LossCost(0.0, 0.0, 0)))
    table = combine(graph, measurements, torch.device("cpu"), ProfileOptions(), use_ort=True)
    assert table.source.calibration["backward_ratios"] == {"linear": 2.0, "relu": 1.0}
    for b in (2, 4):
        assert table.total_forward_s(b) == pytest.approx(0.010 * b)
        assert table.total_backward_s(b) == pytest.approx(0.020 * b)
        # forward is split by onnxruntime's shares (2:1), not torch's (3:1)
        assert table.forward_s(linears[0], b) == pytest.approx(2 * table.forward_s(relus[0], b))
        # backward = forward x kind ratio, rescaled to the measured total
        assert table.backward_s(linears[0], b) == pytest.approx(4 * table.backward_s(relus[0], b))
    assert table.cost(linears[0]).saved == Curve(((2.0, 200.0), (4.0, 400.0)))
    assert {table.cost(n).method for n in linears + relus} == {"onnxruntime"}
