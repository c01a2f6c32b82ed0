"""Frontend: a user's model file -> the model's operator graph.

In: a model file (`build_model()`, `example_inputs(batch_size)`, optional `loss_fn`/`batches`).
Out: `CaptureResult` (partc.frontend.capture): the `OpGraph` (partc.graph) together with the
torch.export `Capture` it was built from (at the batch size B and at 2B, which tells batch
dimensions and per-sample FLOPs) and the ONNX export mapped back to OpGraph nodes.

    model_file -> export (torch.export) -> onnx_export -> graph_builder (+ flop_count) -> OpGraph
"""
