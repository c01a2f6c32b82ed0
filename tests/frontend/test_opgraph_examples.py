"""OpGraphs of the shipped examples: counts, FLOPs against hand-computed values, tied weights,
skip connections, batch scaling, ONNX mapping. Real torch.export + torch.onnx captures."""
from __future__ import annotations

import operator

import pytest
from conftest import EXAMPLES

from partc.frontend.flop_count import flop_counter_mode
from partc.frontend.model_file import load_model_file
from partc.graph.opgraph import OpGraph

B = 2
ALL = ["mlp", "transformer", "bert", "gpt2", "resnet"]


def _linear_flops(graph: OpGraph, node_name: str) -> int:
    node = graph.node(node_name)
    weight = graph.param(node.params[0])
    out_features, in_features = weight.shape
    rows = graph.tensor(node.inputs[0]).numel // in_features
    return 2 * rows * in_features * out_features


@pytest.mark.parametrize("name", ALL)
def test_counts_match_the_exported_program_and_the_model(capture_example, name: str) -> None:
    result = capture_example(name)
    graph, ep = result.graph, result.capture.exported
    # One OpGraph node per call_function, minus getitems folded into their multi-output producer.
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    folded = [n for n in calls if n.target is operator.getitem]
    assert len(graph.nodes) == len(calls) - len(folded)
    # Parameter elements equal the model's own count (tied tensors once).
    model = load_model_file(EXAMPLES / f"{name}.py").build()
    assert graph.num_parameters == sum(p.numel() for p in model.parameters())
    names = {p.name for p in graph.params if p.kind == "parameter"}
    names |= {a for p in graph.params if p.kind == "parameter" for a in p.aliases}
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    # Every node input is a known tensor, every param reference is a known param.
    for node in graph.nodes:
        for t in node.inputs:
            graph.tensor(t)
        for p in node.params:
            graph.param(p)
    assert graph.outputs and all(graph.producer(o.tensor) for o in graph.outputs)


@pytest.mark.parametrize("name", ALL)
def test_total_flops_equal_eager_flop_counter(capture_example, name: str) -> None:
    """Per-node counting on fake tensors adds up to the count of a real eager forward."""
    graph = capture_example(name).graph
    mf = load_model_file(EXAMPLES / f"{name}.py")
    model = mf.build().train()
    args, kwargs = mf.inputs(B)
    with flop_counter_mode() as counter:
        model(*args, **kwargs)
    assert graph.total_flops == counter.get_total_flops() > 0


def test_mlp_linear_flops_hand_computed(capture_example) -> None:
    graph = capture_example("mlp").graph
    linears = [n for n in graph.nodes if n.kind == "linear"]
    assert len(linears) == 6
    dims = [(64, 256)] + [(256, 256)] * 4 + [(256, 10)]
    for node, (d_in, d_out) in zip(linears, dims, strict=True):  # six of each
        assert node.flops == 2 * B * d_in * d_out
        assert node.flops_per_sample == 2 * d_in * d_out
        assert node.flops == _linear_flops(graph, node.name)
    assert graph.total_flops == sum(2 * B * i * o for i, o in dims)


def test_conv_flops_hand_computed(capture_example) -> None:
    graph = capture_example("resnet").graph
    convs = {n.module: n for n in graph.nodes if n.kind == "conv2d"}
    # stem: 3 -> 16 channels, 3x3, 32x32 output
    assert convs["stem.0"].flops == 2 * B * 16 * 32 * 32 * 3 * 3 * 3
    # first conv of stage 2: 16 -> 32 channels, 3x3, stride 2 -> 16x16 output
    assert convs["layers.2.conv1"].flops == 2 * B * 32 * 16 * 16 * 16 * 3 * 3
    # its 1x1 strided shortcut
    assert convs["layers.2.shortcut.0"].flops == 2 * B * 32 * 16 * 16 * 16
    fc = next(n for n in graph.nodes if n.module == "fc")
    assert fc.flops == 2 * B * 64 * 10


def test_attention_flops_hand_computed(capture_example) -> None:
    # TinyLM: d_model 128, 4 heads of 32, sequence 32. torch counts QK^T and PV: 2 x 2*B*H*S*S*D.
    graph = capture_example("transformer").graph
    sdpa = [n for n in graph.nodes if n.kind == "scaled_dot_product_attention"]
    assert len(sdpa) == 4
    for node in sdpa:
        assert node.flops == 4 * B * 4 * 32 * 32 * 32
    bert = capture_example("bert").graph
    bert_sdpa = [n for n in bert.nodes if n.kind == "scaled_dot_product_attention"]
    assert [n.flops for n in bert_sdpa] == [4 * B * 4 * 32 * 32 * 64] * 4
    query = next(n for n in bert.nodes if n.module == "bert.encoder.layer.0.attention.self.query")
    assert query.flops == 2 * B * 32 * 256 * 256


@pytest.mark.parametrize("name, canonical, alias", [
    ("transformer", "tok.weight", "head.weight"),
    ("gpt2", "transformer.wte.weight", "lm_head.weight"),
    ("bert", "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
])
def test_tied_weights_are_one_parameter(capture_example, name: str, canonical: str,
                                        alias: str) -> None:
    graph = capture_example(name).graph
    param = graph.param(alias)
    assert param is graph.param(canonical)
    assert param.name == canonical and alias in param.aliases
    users = [n for n in graph.nodes if canonical in n.params]
    kinds = {n.kind for n in users}
    assert "embedding" in kinds and "linear" in kinds  # used at both ends of the graph
    assert not any(alias in n.params for n in graph.nodes)


def test_residual_skip_edges_are_present(capture_example) -> None:
    graph = capture_example("resnet").graph
    # layers.1 has an identity shortcut: its residual add reads the block's input, produced in
    # layers.0, skipping over the block's two convolutions.
    add = next(n for n in graph.nodes if n.module == "layers.1" and n.kind == "add")
    sources = {graph.node(graph.producer(t)).module for t in add.inputs}
    assert "layers.0" in sources and "layers.1.bn2" in sources
    skip = [e for e in graph.edges()
            if e.dst == add.name and graph.node(e.src).module == "layers.0"]
    assert skip and skip[0].tensor.shape == (B, 16, 32, 32)

    lm = capture_example("transformer").graph
    # the residual stream of block 1 comes from block 0 while also feeding ln1
    adds = [n for n in lm.nodes if n.module == "blocks.1" and n.kind == "add"]
    first = adds[0]
    producers = {lm.node(lm.producer(t)).module for t in first.inputs if lm.producer(t)}
    assert "blocks.0" in producers and "blocks.1.attn.proj" in producers


def test_batch_dimensions_and_scaling(capture_example) -> None:
    graph = capture_example("bert").graph
    assert all(t.batch_dim == 0 for t in graph.inputs)
    for node in graph.nodes:
        for t in node.outputs:
            if t.batch_dim is not None:
                assert t.shape[t.batch_dim] % B == 0
                assert t.nbytes_at(2 * B, B) == 2 * t.nbytes
            else:
                assert t.nbytes_at(64, B) == t.nbytes
    # position ids do not depend on the batch, embeddings of tokens do
    word = next(n for n in graph.nodes if n.module == "bert.embeddings.word_embeddings")
    assert word.outputs[0].batch_dim == 0
    # FLOPs scale exactly with the batch: per-sample slope x batch for every op
    assert all(n.flops == n.flops_per_sample * B for n in graph.nodes)
    # and the slope is right: recapturing at batch 3 gives flops_at(3)
    again = capture_example("bert", batch_size=3).graph
    # strict=False: two captures, compared pair by pair by name as before
    for a, b in zip(graph.nodes, again.nodes, strict=False):
        assert a.name == b.name and a.flops_at(3, B) == b.flops


def test_multi_output_ops_are_folded(capture_example) -> None:
    graph = capture_example("transformer").graph
    split = next(n for n in graph.nodes if n.kind == "split")
    assert [t.name for t in split.outputs] == [f"{split.name}.{i}" for i in range(3)]
    consumers = [n for n in graph.nodes if any(t.startswith(split.name + ".") for t in n.inputs)]
    assert consumers and not any(n.kind == "getitem" for n in graph.nodes)


@pytest.mark.parametrize("name", ALL)
def test_onnx_nodes_map_back_to_op_nodes(capture_example, name: str) -> None:
    result = capture_example(name)
    graph, onnx_model = result.graph, result.onnx.model
    assert graph.onnx.status == "ok" and graph.onnx.opset >= 18
    assert graph.onnx.num_nodes == len(onnx_model.graph.node)
    # Every ONNX node carrying FX metadata is attributed to an OpGraph node.
    assert graph.onnx.mapped_nodes == graph.onnx.num_nodes
    mapped = [o for n in graph.nodes for o in n.onnx_nodes]
    assert sorted(mapped) == sorted(o.name for o in onnx_model.graph.node)
    # Every op that does compute has ONNX nodes (only no-ops such as asserts may lack them).
    for node in graph.nodes:
        if node.flops or node.kind in ("layer_norm", "gelu", "softmax", "relu", "embedding"):
            assert node.onnx_nodes, node.name
    # Shape inference typed (almost) every ONNX output with a static shape.
    assert graph.onnx.static_shape_outputs >= 0.85 * graph.onnx.num_outputs


def test_module_paths_from_the_module_tree(capture_example) -> None:
    graph = capture_example("gpt2").graph
    modules = {n.module for n in graph.nodes}
    assert {"transformer.h.0.attn", "transformer.h.3.mlp.c_fc", "lm_head"} <= modules
    assert graph.module_type("transformer.h") == "torch.nn.modules.container.ModuleList"
    assert graph.module_type("transformer.h.0").endswith("GPT2Block")
    attn = next(n for n in graph.nodes if n.kind == "scaled_dot_product_attention")
    assert attn.module == "transformer.h.0.attn"


def test_views_move_no_bytes_and_gathers_read_rows(capture_example) -> None:
    graph = capture_example("gpt2").graph
    views = [n for n in graph.nodes if n.kind in ("view", "transpose", "expand")]
    assert views and all(n.is_view and n.bytes_read == n.bytes_written == 0 for n in views)
    wte = next(n for n in graph.nodes if n.module == "transformer.wte")
    assert wte.bytes_read == wte.outputs[0].nbytes + graph.tensor(wte.inputs[0]).nbytes
    lm_head = next(n for n in graph.nodes if n.module == "lm_head")
    assert lm_head.bytes_read == graph.param("lm_head.weight").nbytes \
        + graph.tensor(lm_head.inputs[0]).nbytes
