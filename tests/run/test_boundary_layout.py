"""A stage boundary right after attention's transposed query, key and value views: the runtime
sends them in the memory order the unsplit model had them in (plan.yaml's `wire_order`), so the
next stage computes on the layouts the unsplit model did and the gradients flow back in them.

Found in a 4-process run of the transformer example (docs/benchmarks.md, "Boundary layouts"):
sent as plain contiguous copies, the received query made the attention's output contiguous in
(batch, heads, seq, dim), so the reshape after it copied (a view unsplit), and the gradients
arriving for the sent views made every view's backward reshape copy: 256 and 512 KiB above the
memory model, which prices the unsplit model's layouts. Real torch.export, real stage graphs,
real autograd, torch.profiler's allocation events."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from partc.cost.activations import saved_activations
from partc.cost.roofline import analytic_cost_table
from partc.cost.torch_profiler import allocation_events
from partc.emit.stage_graph import memory_order, split_program
from partc.frontend.capture import CaptureResult, capture_graph
from partc.plans.plan import TensorRef
from partc.run.stage_runner import StageRunner, needs_runner
from partc.solve.memory import _backward_transient, _requires_grad

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "solve"))
from test_memory import cpu_device  # noqa: E402

_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

class CutAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.norm = nn.LayerNorm(64)
        self.qkv = nn.Linear(64, 192)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 100)

    def forward(self, ids):
        x = self.norm(self.emb(ids))
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, 4, d // 4).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.proj(y.transpose(1, 2).reshape(b, s, d)))

def build_model():
    torch.manual_seed(0)
    return CutAttention()

def example_inputs(b):
    return (torch.randint(0, 100, (b, 16)),)
'''
BATCH = 8


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory) -> tuple[CaptureResult, list[str], list[str]]:
    """The model captured, and its nodes before and from the attention (the two stages)."""
    path = tmp_path_factory.mktemp("layout") / "cut_attention.py"
    path.write_text(_MODEL)
    result = capture_graph(path, BATCH, onnx=False)
    names = [n.name for n in result.graph.nodes]
    at = next(i for i, n in enumerate(result.graph.nodes)
              if n.kind == "scaled_dot_product_attention")
    return result, names[:at], names[at:]


def _runners(result: CaptureResult, first: list[str],
             layouts: bool) -> tuple[StageRunner, StageRunner, list[TensorRef]]:
    """Both stages as launch runs them, with the plan's boundary orders or (`layouts` off) the
    plain contiguous copies partc sent before."""
    split = split_program(result.capture.exported, {n: 0 if n in first else 1
                                                    for n in (x.name for x in result.graph.nodes)},
                          2)
    sent = [TensorRef(name=n, shape=split.tensors[n].shape, dtype=split.tensors[n].dtype,
                      peer=(1,), wire_order=split.tensors[n].memory_order if layouts else ())
            for n in split.stages[0].outputs]
    cpu = torch.device("cpu")
    sender = StageRunner(split.stages[0].module, cpu, bf16=False, checkpointing=False, last=False,
                         output_orders=tuple(r.wire_order for r in sent))
    receiver = StageRunner(split.stages[1].module, cpu, bf16=False, checkpointing=False,
                           last=True, input_orders=tuple(r.wire_order for r in sent))
    return sender, receiver, sent


def test_transposed_views_are_sent_in_their_memory_order(cut: tuple) -> None:
    result, first, _ = cut
    sender, receiver, sent = _runners(result, first, layouts=True)
    # the three (batch, heads, seq, dim) views of a (batch, seq, 3 x width) buffer
    orders = [r.wire_order for r in sent if len(r.shape) == 4]
    assert orders == [(0, 2, 1, 3)] * 3
    assert [r.wire_shape for r in sent if len(r.shape) == 4] == [(BATCH, 16, 4, 16)] * 3
    ids = result.capture.model_file.inputs(BATCH)[0][0]
    wire = sender(ids)
    assert all(w.is_contiguous() and w.shape == r.wire_shape
               for w, r in zip(wire, sent, strict=True))
    # the receiver views them back: logical shape, the unsplit model's stride order
    received = [w.detach().requires_grad_() for w in wire]
    viewed = [w.permute(v) if v else w for w, v in zip(received, receiver.input_views, strict=True)]
    assert [tuple(v.shape) for v in viewed] == [r.shape for r in sent]
    assert [memory_order(v) for v in viewed] == [r.wire_order for r in sent]
    # and the split computes what the unsplit model computes, its gradients too
    model = result.capture.model_file.build()
    whole = model(ids)
    (out,) = receiver(*received)
    torch.testing.assert_close(out, whole)
    grad = torch.randn_like(whole)
    torch.autograd.backward(whole, grad)
    torch.autograd.backward(out, grad)
    torch.autograd.backward(wire, [r.grad for r in received])
    split_grads = {n: p.grad for stage in (sender.stage, receiver.stage)
                   for n, p in stage.named_parameters() if p.grad is not None}
    assert split_grads.keys() == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(split_grads[n], p.grad, msg=n)


def _allocations(fn: object) -> tuple[list[tuple[int, int, int]], torch.profiler.profile]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()  # type: ignore[operator]
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    return allocation_events(prof.profiler.kineto_results.experimental_event_tree()), prof


@pytest.mark.parametrize("layouts", [True, False])
def test_the_sending_stage_backward_allocates_what_the_memory_model_says(
        cut: tuple, layouts: bool) -> None:
    """The sender's backward from the received gradients: the view chain hands them back as
    views and the split concatenates them, the memory model's account exactly. Sent as plain
    contiguous copies (`layouts` off), every view's reshape copied its gradient: above it."""
    result, first, _ = cut
    graph = result.graph
    table = analytic_cost_table(graph, cpu_device(), saved=saved_activations(result.capture))
    sender, _, refs = _runners(result, first, layouts)
    requires = _requires_grad(graph)
    predicted, _ = _backward_transient(table, first, BATCH, False, requires, {},
                                       {r.name for r in refs})
    ids = result.capture.model_file.inputs(BATCH)[0][0]
    with torch.jit.optimized_execution(False):
        outputs = sender(ids)
        received = [torch.randn_like(o) for o in outputs]  # the receive buffers: held
        events, _ = _allocations(lambda: torch.autograd.backward(outputs, received))
    live = peak = 0
    for _, size, _ in events:
        live += size
        peak = max(peak, live)
    if layouts:
        assert peak == predicted, (peak, predicted)
    else:
        assert peak > predicted  # what the test guards against


def test_the_receiving_attention_output_reshape_stays_a_view(cut: tuple) -> None:
    """Received in the unsplit memory order, the query makes the attention's output in the
    unsplit layout, and the reshape after it is a view, as unsplit: no copy in the receiving
    stage's forward. Received as plain contiguous copies, the reshape copied."""
    result, first, _ = cut

    def copies(layouts: bool) -> int:
        sender, receiver, _ = _runners(result, first, layouts)
        ids = result.capture.model_file.inputs(BATCH)[0][0]
        received = [w.detach().requires_grad_() for w in sender(ids)]
        with torch.jit.optimized_execution(False):
            _, prof = _allocations(lambda: receiver(*received))
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::clone",
                                                                       "aten::contiguous"))

    assert copies(layouts=True) == 0
    assert copies(layouts=False) > 0


def test_a_last_stage_receiving_a_transposed_view_runs_in_a_runner() -> None:
    """launch wraps a stage's module in a StageRunner only where it must; a last stage that
    receives a tensor in another memory order must be, to view it back (BERT x2 cut after two
    of attention's projections, run AN: its fp32 last stage got the (b, s, h, d) buffers as they
    came, and the attention failed on their shape)."""
    from partc.plans.plan import load_plan

    plan = load_plan(Path(__file__).resolve().parents[2] / "examples" / "plans" / "mlp"
                     / "plan.yaml")
    first, last = plan.stages
    assert not plan.training.config.bf16 and not last.activation_checkpointing
    assert needs_runner(plan, first) and not needs_runner(plan, last)
    ref = last.inputs[0]
    transposed = replace(ref, shape=(*ref.shape, 1), wire_order=(0, 2, 1))
    assert needs_runner(plan, replace(last, inputs=(transposed, *last.inputs[1:])))
