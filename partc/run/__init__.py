"""Run: a plan directory -> training on torch.distributed (`partc launch`).

In: a validated Plan whose stage files match their hashes. `launch` checks everything it can and
starts one process per device through torchrun's elastic agent, forked from a forkserver that
imported torch once; each process (`worker`, also what `python -m partc.launch` runs under a
user's torchrun) runs `runtime.run_rank` with its rank's place from `rank_layout`, and writes
`checkpoint`s. `training` holds what a run is independent of its distribution (options,
optimizer, batches, seeds) and the single-process run it is checked against.
"""
