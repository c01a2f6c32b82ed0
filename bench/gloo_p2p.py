"""What a gloo point-to-point transfer costs the two processes: the facts behind the simulator's
gloo model (docs/simulator.md#gloo-sends-rendezvous-copies-on-both-cores).

Two processes pinned to cores 0 and 1 (as `partc launch` pins its workers), one thread each,
gloo over loopback. For each message size:

- one-way time: rank 0 isends, rank 1 irecvs, both wait (median and mean over the repeats);
- exchange: both send to each other at once (`batch_isend_irecv`, as 1F1B's steady state
  meets its neighbour, and as `partc calibrate` times the link), mean, and its ratio to the
  one-way mean (the simulator charges two crossing transfers twice one);
- rendezvous: rank 1 posts its receive `--late-ms` after rank 0 posted its send; rank 0's wait
  (a send that moved without the receive would return in about the one-way time);
- early receive: rank 1 posts its receive 2 ms before rank 0 posts its send (as partc's runtime
  posts a step's receives at its start); rank 0's post + wait, against the one-way time;
- post: how long rank 0's isend call itself takes;
- CPU in the calls (the early-receive repeats, `time.thread_time()` of the calling thread, as
  launch's P2PTimer takes it): rank 0's isend (gloo writes the bytes into the socket from the
  posting thread when the receive's notice is there), rank 1's irecv post and its wait;
- copy on the sender: rank 0 posts its send and computes a fixed matmul loop while the bytes
  move (rank 1 already waiting): how much longer the loop takes than alone, timed right before
  in the same repeat;
- copy on the receiver: rank 1 posts its receive and computes the loop while rank 0 sends.

Prints a markdown table (medians over `--repeats`), or JSON with --json. About 30 s.

Usage: python bench/gloo_p2p.py [--repeats 40] [--late-ms 20] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = (1, 1 << 16, 1 << 20, 4 << 20, 16 << 20, 64 << 20)


def _wait(work: Any) -> None:
    """Wait for a p2p request (torch types isend/irecv as possibly returning None)."""
    if work is not None:
        work.wait()


def _worker(rank: int, port: int, repeats: int, late_s: float, out: str) -> None:
    import torch
    import torch.distributed as dist

    from partc.hardware.local import pin_to_core

    pin_to_core(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    peer = 1 - rank
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def compute() -> None:
        for _ in range(40):
            torch.mm(a, b)

    def timed(fn: Any) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for _ in range(5):
        compute()
    compute_s = statistics.median(timed(compute) for _ in range(30))
    rows: dict[str, Any] = {"compute_alone_ms": compute_s * 1e3, "sizes": {}}
    for nbytes in SIZES:
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        # torch types isend as returning Work or None and irecv as Work: one callable type
        op: Callable[[torch.Tensor, int], Any] = dist.isend if rank == 0 else dist.irecv
        for _ in range(3):  # warm the connection
            dist.barrier()
            _wait(op(tensor, peer))
        one_way: list[float] = []
        exchange: list[float] = []
        late: list[float] = []
        early: list[float] = []
        send_cpu: list[float] = []
        recv_post_cpu: list[float] = []
        recv_wait_cpu: list[float] = []
        post: list[float] = []
        send_copy: list[float] = []
        recv_copy: list[float] = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            _wait(op(tensor, peer))
            one_way.append(time.perf_counter() - start)
        received = torch.empty_like(tensor)
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer),
                                                dist.P2POp(dist.irecv, received, peer)]):
                _wait(work)
            exchange.append(time.perf_counter() - start)
        for _ in range(max(3, repeats // 5)):
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                _wait(dist.isend(tensor, peer))
                late.append(time.perf_counter() - start)
            else:
                time.sleep(late_s)
                _wait(dist.irecv(tensor, peer))
        for _ in range(repeats):
            dist.barrier()
            if rank == 0:
                time.sleep(0.002)  # the receive's "ready" notice has been handled by now
                start, cpu = time.perf_counter(), time.thread_time()
                posted = dist.isend(tensor, peer)
                send_cpu.append(time.thread_time() - cpu)
                _wait(posted)
                early.append(time.perf_counter() - start)
            else:
                cpu = time.thread_time()
                posted = dist.irecv(tensor, peer)
                recv_post_cpu.append(time.thread_time() - cpu)
                cpu = time.thread_time()
                _wait(posted)
                recv_wait_cpu.append(time.thread_time() - cpu)
        # Each repeat times the loop alone, then with the transfer: the machine's drift cancels.
        for computing, slower in ((0, send_copy), (1, recv_copy)):
            for _ in range(repeats):
                dist.barrier()
                alone_s = timed(compute) if rank == computing else 0.0
                dist.barrier()
                if rank != computing:
                    if rank == 0:
                        time.sleep(0.0005)  # the receiver is computing when the bytes come
                    _wait(op(tensor, peer))
                    continue
                start = time.perf_counter()
                work = op(tensor, peer)
                if rank == 0:
                    post.append(time.perf_counter() - start)
                slower.append(timed(compute) - alone_s)
                _wait(work)
        ms = 1e3
        rows["sizes"][str(nbytes)] = (
            {"one_way_ms_median": statistics.median(one_way) * ms,
             "one_way_ms_mean": statistics.mean(one_way) * ms,
             "exchange_ms_mean": statistics.mean(exchange) * ms,
             "late_receiver_wait_ms": statistics.median(late) * ms,
             "early_receiver_wait_ms": statistics.median(early) * ms,
             "post_ms": statistics.median(post) * ms,
             "isend_cpu_ms": statistics.median(send_cpu) * ms,
             "sender_compute_slower_ms": statistics.median(send_copy) * ms}
            if rank == 0 else
            {"receiver_compute_slower_ms": statistics.median(recv_copy) * ms,
             "irecv_post_cpu_ms": statistics.median(recv_post_cpu) * ms,
             "irecv_wait_cpu_ms": statistics.median(recv_wait_cpu) * ms})
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        merged = gathered[0]
        for size, row in gathered[1]["sizes"].items():
            merged["sizes"][size].update(row)
        Path(out).write_text(json.dumps(merged))
    dist.destroy_process_group()


def measure(repeats: int, late_ms: float) -> dict[str, Any]:
    """Run the two processes and return rank 0's merged rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = Path(f"/tmp/partc-gloo-p2p-{os.getpid()}.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(rank, port, repeats, late_ms / 1e3, str(out)))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit("gloo_p2p: a worker failed")
    try:
        return dict(json.loads(out.read_text()))
    finally:
        out.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--late-ms", type=float, default=20.0,
                        help="how late the receiver posts in the rendezvous probe")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    found = measure(args.repeats, args.late_ms)
    print(f"compute loop alone: {found['compute_alone_ms']:.2f} ms (median of 30)")
    print(f"\n| bytes | one-way ms (median / mean) | exchange ms (mean) | exchange / one-way "
          f"| sender's wait, receive posted "
          f"{args.late_ms:g} ms late | sender's post + wait, receive posted 2 ms early "
          "| isend post ms | computation slower on the sender, ms "
          "| on the receiver, ms | CPU ms in the isend, receive posted early "
          "| in the irecv post | in its wait |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size, row in found["sizes"].items():
        print(f"| {int(size):,} | {row['one_way_ms_median']:.2f} / {row['one_way_ms_mean']:.2f} "
              f"| {row['exchange_ms_mean']:.2f} "
              f"| {row['exchange_ms_mean'] / row['one_way_ms_mean']:.2f} "
              f"| {row['late_receiver_wait_ms']:.2f} | {row['early_receiver_wait_ms']:.3f} "
              f"| {row['post_ms']:.3f} "
              f"| {row['sender_compute_slower_ms']:.2f} "
              f"| {row['receiver_compute_slower_ms']:.2f} | {row['isend_cpu_ms']:.3f} "
              f"| {row['irecv_post_cpu_ms']:.3f} | {row['irecv_wait_cpu_ms']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
