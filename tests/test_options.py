"""The option types convert to and from dicts and command lines in one place, losslessly."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from partc.errors import LaunchError, MemoryConfigError, SearchError
from partc.options import (
    OPTIMIZER_SPECS,
    OPTIMIZERS,
    ElasticOptions,
    SearchOptions,
    TrainingConfig,
    TrainOptions,
    add_arguments,
    flagged_fields,
    from_dict,
    from_flags,
    from_namespace,
    to_argv,
    to_dict,
)

CASES = [
    TrainingConfig(),
    TrainingConfig(optimizer="sgd-momentum", precision="bf16-mixed", memory_margin=0.25),
    SearchOptions(),
    SearchOptions(strategy="uniform", stages=4, replicas=2, num_microbatches=8,
                  schedule="interleaved-1f1b", activation_checkpointing=False, max_blocks=64,
                  time_limit_s=2.5, refine=3),
    SearchOptions(activation_checkpointing=True),
    TrainOptions(),
    TrainOptions(steps=7, seed=3, lr=2e-4, weight_decay=0.0, checkpoint_dir=Path("ck pt"),
                 checkpoint_every=2, keep_checkpoints=5, resume=True,
                 init_from=Path("/tmp/w.pt"), metrics=Path("m.jsonl"), log_every=3),
    ElasticOptions(nnodes=2, node_rank=1, rdzv_endpoint="host:29400", max_restarts=2),
]


def _parse(cls: type, argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return from_namespace(cls, parser.parse_args(argv))


@pytest.mark.parametrize("options", CASES, ids=lambda o: type(o).__name__)
def test_argv_round_trip(options: object) -> None:
    argv = to_argv(options)
    assert _parse(type(options), argv) == options
    # Only what differs from the defaults is written: a default object needs no flags.
    if options == type(options)():
        assert argv == []


@pytest.mark.parametrize("options", CASES, ids=lambda o: type(o).__name__)
def test_dict_round_trip(options: object) -> None:
    data = to_dict(options)
    assert all(not isinstance(v, Path) for v in data.values())  # plain data
    assert from_dict(type(options), data) == options


def test_flags_read_only_their_own_fields() -> None:
    # One command line holds SearchOptions' pinned schedule (None) next to TrainingConfig's
    # fields: each type reads its own flagged fields only.
    kwargs = {"schedule": None, "activation_checkpointing": None, "optimizer": "adam",
              "precision": "fp32", "memory_margin": 0.2, "strategy": "params", "stages": 2}
    assert from_flags(TrainingConfig, kwargs) == TrainingConfig(optimizer="adam",
                                                                memory_margin=0.2)
    assert from_flags(SearchOptions, kwargs) == SearchOptions(strategy="params", stages=2)
    assert {f.name for f in flagged_fields(TrainingConfig)} == {
        "optimizer", "precision", "memory_margin"}


def test_every_optimizer_is_specified() -> None:
    assert set(OPTIMIZER_SPECS) == set(OPTIMIZERS)


def test_bad_values_are_user_errors() -> None:
    with pytest.raises(MemoryConfigError, match="unknown optimizer 'adamm'") as err:
        TrainingConfig(optimizer="adamm")  # type: ignore[arg-type]
    assert err.value.hint == "did you mean 'adam'?"
    with pytest.raises(SearchError, match="strategy"):
        SearchOptions(strategy="greedy")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="--resume needs --checkpoint-dir"):
        TrainOptions(resume=True)
