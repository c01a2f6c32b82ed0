"""Calibrate this machine's CPU as a partc device and cluster: `partc calibrate --device cpu` with
this repository's configs/ as the default output.

Writes configs/devices/cpu.yaml (matmul/conv/attention FLOP/s, memory bandwidth, per-operator
forward and backward overheads, the pipelining runtime's overhead per stage pass, memory per
device) and configs/clusters/cpu.yaml (one node of `cores / threads` such devices; the
intra-node link is measured: gloo between two local processes pinned to their cores, exchanging
1 B for latency and 64 MiB for bandwidth, means). configs/clusters/cpu-4.yaml takes the same
link by hand. Takes about 35 s. Other processes
lower every number (cores and memory bandwidth are shared): the script reports how much CPU they
used meanwhile and warns above 10% of a core; rerun on an idle machine then. The measuring is
partc.hardware.calibration.calibrate (docs/hardware.md#the-cpu-device).

Usage: python bench/calibrate_cpu.py [--threads 1] [--seconds 20] [--out configs] [--no-gloo]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partc.hardware.calibration import format_calibration  # noqa: E402
from partc.run.overhead import calibrate_machine  # noqa: E402

COMMAND = "python bench/calibrate_cpu.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="cores (threads) per device")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="time budget of the device measurements")
    parser.add_argument("--out", type=Path, default=ROOT / "configs",
                        help="configs folder to write devices/cpu.yaml and clusters/cpu.yaml into")
    parser.add_argument("--no-gloo", action="store_true",
                        help="skip the gloo measurement (the link is then a placeholder)")
    args = parser.parse_args(argv)

    command = f"{COMMAND} --threads {args.threads} --seconds {args.seconds:g}"
    result = calibrate_machine(args.out, "cpu", name="cpu", threads=args.threads,
                               seconds=args.seconds, measure_link=not args.no_gloo,
                               command=command)
    if result.other_processes_cores > 0.1:
        print(f"warning: other processes used {result.other_processes_cores:.0%} of a core "
              "during the calibration; its numbers are low, rerun on an idle machine",
              file=sys.stderr)
    print(format_calibration(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
