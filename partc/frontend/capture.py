"""The front half as one call: model file -> torch.export capture -> ONNX -> OpGraph."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from partc.frontend.export import Capture, capture
from partc.frontend.graph_builder import build_opgraph
from partc.frontend.model_file import load_model_file
from partc.frontend.onnx_export import OnnxExport, export_onnx
from partc.graph.opgraph import OpGraph
from partc.progress import Progress

GRAPH_FILE = "graph.json"
ONNX_FILE = "model.onnx"


@dataclass
class CaptureResult:
    """Everything the capture produced: the OpGraph and the artifacts it was built from."""

    graph: OpGraph
    capture: Capture
    onnx: OnnxExport | None

    def save(self, directory: str | Path) -> dict[str, Path]:
        """Write graph.json (and model.onnx when the export worked) into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written: dict[str, Path] = {}
        if self.onnx is not None and self.onnx.model is not None:
            written["onnx"] = self.onnx.save(directory / ONNX_FILE)
            self.graph = replace(self.graph, onnx=replace(self.graph.onnx, file=ONNX_FILE))
        written["graph"] = self.graph.save(directory / GRAPH_FILE)
        return written


def capture_graph(model_path: str | Path, batch_size: int, *, onnx: bool = True,
                  progress: Progress | None = None) -> CaptureResult:
    """Load a model file, capture it at `batch_size`, export it to ONNX (unless `onnx=False`) and
    build its OpGraph. ONNX failure is a warning (recorded in graph.onnx), not an error."""
    progress = progress or Progress()
    with progress.step(f"loading {model_path}"):
        model_file = load_model_file(model_path)
    cap = capture(model_file, batch_size, progress)
    onnx_export = export_onnx(cap, progress) if onnx else None
    graph = build_opgraph(cap, onnx_export, progress)
    return CaptureResult(graph=graph, capture=cap, onnx=onnx_export)
