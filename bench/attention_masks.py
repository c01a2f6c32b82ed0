"""What dropping constant attention masks (partc.frontend.attention_masks) changes in time: a model
file's exported program, forward + backward, with and without the pass, on this machine.

Both programs come from the same model at the same batch; they run alternately in one process
(the order flips every iteration), so machine drift hits both alike. Prints the median and
minimum of each and their ratio; with --check, also that both compute the same outputs (dropout
off or not: each iteration reseeds before each program).

    .venv/bin/python bench/attention_masks.py examples/gpt2.py --batch-sizes 4,8
    .venv/bin/python bench/attention_masks.py examples/gpt2.py --device cuda --batch-sizes 8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

from partc.frontend.attention_masks import SDPA, simplify_attention_masks  # noqa: E402
from partc.frontend.model_file import load_model_file  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a partc model file")
    parser.add_argument("--batch-sizes", default="4,8")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model_file = load_model_file(args.model)
    model = model_file.build().to(device).train()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    print(f"{model_file.name} on {device}, torch {torch.__version__}, {args.iterations} "
          f"alternating iterations after {args.warmup} warm-up, fwd+bwd ms")
    print("| batch | masked median (min) | simplified median (min) | simplified/masked | "
          "attention calls rewritten |")
    print("|---:|---:|---:|---:|---|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        inputs = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                                 model_file.inputs(batch))
        call_args, call_kwargs = inputs
        masked = torch.export.export(model, tuple(call_args), call_kwargs)
        simplified = torch.export.export(model, tuple(call_args), call_kwargs)
        before = [n for n in simplified.graph.nodes if n.target is SDPA]
        simplify_attention_masks(simplified)
        rewritten = sum(1 for n in simplified.graph.nodes if n.target is SDPA
                        and (n.args[3] if len(n.args) > 3 else None) is None)
        programs = {"masked": masked.module(), "simplified": simplified.module()}
        times: dict[str, list[float]] = {name: [] for name in programs}
        for i in range(args.warmup + args.iterations):
            order = list(programs) if i % 2 else list(reversed(programs))
            for name in order:
                module = programs[name]
                torch.manual_seed(i)
                sync()
                t0 = time.perf_counter()
                out = module(*call_args, **call_kwargs)
                loss = sum(t.float().sum() for t in pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.is_floating_point())
                loss.backward()  # type: ignore[union-attr]
                sync()
                if i >= args.warmup:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                for p in module.parameters():
                    p.grad = None
        m, s = (statistics.median(times[k]) for k in ("masked", "simplified"))
        print(f"| {batch} | {m:.2f} ({min(times['masked']):.2f}) | {s:.2f} "
              f"({min(times['simplified']):.2f}) | {s / m:.3f} | {rewritten} of {len(before)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
