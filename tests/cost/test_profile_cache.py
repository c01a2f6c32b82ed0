"""The profile cache compile reads: one measurement per (model, device, precision, threads, batch
sizes), written atomically, a corrupt entry measured again (real profiling of a small model)."""
from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Iterator

import pytest
from conftest import EXAMPLES, TEST_MODELS, captured

from partc.cost.measured import ProfileOptions
from partc.cost.ort_profiler import ProfileError
from partc.cost.profile_cache import cached_profile, profile_cache_dir
from partc.cost.table import CostTable, ProfileFileError
from partc.progress import Progress

# totals timed for 0.2 s, not 1 s: these tests are of the cache, not of the numbers
FAST = ProfileOptions(runs=2, warmup=1, method="torch", totals_budget_s=0.2)


class Steps(Progress):
    """Progress that keeps the steps it ran and the warnings it got: a measurement shows up as
    its "torch: ..." steps."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.warnings: list[str] = []

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        self.steps.append(label)
        yield

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def measured(self) -> bool:
        return any(s.startswith("torch: ") for s in self.steps)


def _cached(options: ProfileOptions = FAST) -> tuple[CostTable, Path, Steps]:
    steps = Steps()
    table, path = cached_profile(captured(EXAMPLES / "mlp.py"), options, progress=steps)
    return table, path, steps


def _lock_of(entry: Path) -> Path:
    return entry.with_name(f".{entry.stem}.lock")


def test_two_callers_at_once_measure_an_entry_once(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """Two compiles needing the same entry at once (two shells, two test workers): the second
    waits on the entry's lock and reads what the first measured, rather than measuring too (and
    timing the first one's work as load). Real threads, real flock (separate open files lock
    each other out within one process too)."""
    import threading

    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path))
    first_in = threading.Event()

    class Signalling(Steps):
        def step(self, label: str):  # type: ignore[override]
            if label.startswith("torch: "):
                first_in.set()  # measuring: the lock is held
            return super().step(label)

    results: dict[str, tuple[CostTable, Path, Steps]] = {}

    def measure(name: str, progress: Steps) -> None:
        table, path = cached_profile(captured(EXAMPLES / "mlp.py"), FAST, progress=progress)
        results[name] = table, path, progress

    a = threading.Thread(target=measure, args=("a", Signalling()))
    a.start()
    assert first_in.wait(120)
    b = threading.Thread(target=measure, args=("b", Steps()))
    b.start()
    a.join(300)
    b.join(300)
    (ta, pa, sa), (tb, pb, sb) = results["a"], results["b"]
    assert pa == pb and sa.measured() and not sb.measured()
    assert "waiting for another partc measuring this profile" in sb.steps
    assert ta.source == tb.source and not sa.warnings and not sb.warnings


def test_cache_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profile_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("PARTC_CACHE_DIR")
    assert profile_cache_dir() == tmp_path / "xdg" / "partc" / "profiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert profile_cache_dir() == tmp_path / "home" / ".cache" / "partc" / "profiles"


def test_second_call_is_a_hit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path / "cache"))
    first, path, steps = _cached()
    assert steps.measured() and path.parent == tmp_path / "cache" and path.is_file()
    assert re.fullmatch(r"[A-Za-z0-9._-]+\.yaml", path.name) and not path.name.startswith(".")
    # no temporary file left behind; the entry's lock (hidden, empty) stays
    assert sorted(path.parent.iterdir()) == sorted([path, _lock_of(path)])
    assert _lock_of(path).stat().st_size == 0
    stamp = path.stat().st_mtime_ns

    again, path2, steps2 = _cached()
    assert path2 == path and path.stat().st_mtime_ns == stamp
    assert not steps2.measured() and not steps2.warnings
    assert again.source == CostTable.load(path, first.graph).source
    assert again.total_forward_s(3) == pytest.approx(first.total_forward_s(3), rel=1e-9)


def test_a_cache_that_cannot_be_written_fails_before_measuring(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cache directory that cannot be made (here under a file, which even root cannot write
    into) failed only after the profile was measured (minutes for a large model): now before,
    in one line with a hint. A read-only cache that holds the entry is still read."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PARTC_CACHE_DIR", str(blocker / "cache"))
    steps = Steps()
    with pytest.raises(ProfileError, match="cannot write the profile cache") as info:
        cached_profile(captured(EXAMPLES / "mlp.py"), FAST, progress=steps)
    assert "PARTC_CACHE_DIR" in (info.value.hint or "") and not steps.measured()


def test_corrupt_entries_are_measured_again(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path))
    table, path, _ = _cached()
    good = path.read_text()
    # unreadable: the one error the cache measures again on (cached_profile), not another
    # exception escaping it
    for text in ("\x00\xff not yaml: [", "format: partc-profile\nnodes: [1, 2]\n"):
        path.write_text(text)
        with pytest.raises(ProfileFileError):
            CostTable.load(path, table.graph)
    again, path2, steps = _cached()
    assert path2 == path and steps.measured() and "is unreadable" in steps.warnings[0]
    assert CostTable.load(path, table.graph).nodes.keys() == table.nodes.keys()
    assert again.nodes.keys() == table.nodes.keys()
    # cut short mid-way through the node lines: unreadable, or (most cuts) valid YAML that lacks
    # nodes, as one node missing is; the cache measures an entry lacking nodes again too
    path.write_text(good[:len(good) // 2])
    with contextlib.suppress(ProfileFileError):
        assert CostTable.load(path, table.graph).nodes.keys() < table.nodes.keys()
    path.write_text(good.rsplit("\n  ", 1)[0] + "\n")
    assert CostTable.load(path, table.graph).nodes.keys() < table.nodes.keys()
    again, path2, steps = _cached()
    assert path2 == path and steps.measured() and "does not match its key" in steps.warnings[0]
    assert CostTable.load(path, table.graph).nodes.keys() == table.nodes.keys()


def test_each_precision_has_its_own_entry(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path))
    fp32, fp32_path, _ = _cached()
    bf16, bf16_path, steps = _cached(ProfileOptions(runs=2, warmup=1, precision="bf16-mixed",
                                                    totals_budget_s=0.2))
    assert bf16_path != fp32_path and steps.measured()
    assert fp32.source.precision == "fp32" and bf16.source.precision == "bf16-mixed"
    assert CostTable.load(bf16_path, bf16.graph, precision="bf16-mixed").source == bf16.source
    # so do other batch sizes and thread counts, and they leave the others in place
    _, sizes_path, _ = _cached(ProfileOptions(runs=2, warmup=1, method="torch", totals_budget_s=0.2,
                                              batch_sizes=(2, 3)))
    _, threads_path, _ = _cached(ProfileOptions(runs=2, warmup=1, method="torch", threads=2,
                                              totals_budget_s=0.2))
    assert len({fp32_path, bf16_path, sizes_path, threads_path}) == 4
    entries = [fp32_path, bf16_path, sizes_path, threads_path]
    assert sorted(tmp_path.iterdir()) == sorted([*entries, *map(_lock_of, entries)])
    _, again, steps = _cached()
    assert again == fp32_path and not steps.measured()


def test_a_larger_set_of_sizes_measures_only_the_missing_ones(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    # compile adds the plan's micro-batch size to a profile (partc.plans.priced_search): the
    # entry at the other sizes is reused (their per-node costs kept, up to one factor per size
    # and direction: their totals are timed again with the new size's), only the new size is
    # measured per node, and the merged table is exact at every measured size
    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path))
    first, first_path, _ = _cached(dataclasses.replace(FAST, batch_sizes=(2, 4)))
    more, path, steps = _cached(dataclasses.replace(FAST, batch_sizes=(2, 4, 16)))
    assert path != first_path and more.source.batch_sizes == (2, 4, 16)
    measured = [s for s in steps.steps if s.startswith("torch: ")]
    assert measured and all("batch 16" in s for s in measured), measured
    for b in (2, 4):
        scale = more.source.calibration["measured"][str(b)]["retimed"]
        for name, cost in first.nodes.items():  # both as their files hold them
            assert more.forward_s(name, b) == pytest.approx(
                cost.forward.at(b) * scale["forward_scale"], rel=1e-4, abs=1e-12)
            assert more.backward_s(name, b) == pytest.approx(
                cost.backward.at(b) * scale["backward_scale"], rel=1e-4, abs=1e-12)
    assert more.loss.forward.at(2) == first.loss.forward.at(2)
    # the file holds the three sizes and reads back to the same costs
    again = CostTable.load(path, more.graph)
    assert again.source.batch_sizes == (2, 4, 16)
    assert all(again.forward_s(n, b) == pytest.approx(more.forward_s(n, b), rel=1e-11)
               for n in more.nodes for b in (2, 4, 16))
    # and a later ask for those sizes is a plain hit
    _, _, hit = _cached(dataclasses.replace(FAST, batch_sizes=(2, 4, 16)))
    assert not hit.measured()


def test_an_extension_times_the_entrys_totals_again_with_its_own(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # An entry measured when the machine ran a thousand times slower (its size-4 costs scaled so
    # in the file): the size a later compile adds is timed in the same rounds as the entry's
    # sizes again, which are scaled to their new totals, so that the old sitting's speed is not
    # read as what a larger micro-batch costs. (A factor far beyond this machine's noise: under
    # the parallel test run a 1 ms model's totals move several-fold between two timings.)
    import yaml

    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path))
    first, first_path, _ = _cached(dataclasses.replace(FAST, batch_sizes=(2, 4)))
    data = yaml.safe_load(first_path.read_text())
    for row in data["nodes"].values():  # [method, [fwd], [bwd], [saved]] at sizes 2 and 4
        row[1][1] *= 1000
        row[2][1] *= 1000
    first_path.write_text(yaml.safe_dump(data, sort_keys=True))
    slow = CostTable.load(first_path, first.graph)
    assert slow.total_forward_s(4) == pytest.approx(1000 * first.total_forward_s(4), rel=1e-4)
    more, _, steps = _cached(dataclasses.replace(FAST, batch_sizes=(2, 4, 16)))
    assert any("batch 16 (and 2, 4 again)" in s for s in steps.steps), steps.steps
    retimed = more.source.calibration["measured"]["4"]["retimed"]
    # about 1/1000: the factor put into the file, times this machine's drift between timings
    assert 0 < retimed["forward_scale"] < 0.03 and 0 < retimed["backward_scale"] < 0.03
    assert more.total_forward_s(4) < 30 * first.total_forward_s(4)
    # each node keeps its share of its size's total
    for name in more.nodes:
        assert more.forward_s(name, 4) == pytest.approx(
            slow.forward_s(name, 4) * retimed["forward_scale"], rel=1e-4, abs=1e-12)
        assert more.backward_s(name, 4) == pytest.approx(
            slow.backward_s(name, 4) * retimed["backward_scale"], rel=1e-4, abs=1e-12)
    # and a later ask for those sizes is a plain hit of what was written
    again, _, hit = _cached(dataclasses.replace(FAST, batch_sizes=(2, 4, 16)))
    assert not hit.measured()
    assert again.total_forward_s(4) == pytest.approx(more.total_forward_s(4), rel=1e-9)


def test_measuring_leaves_the_model_state_as_built() -> None:
    """Measuring runs the model forward in training mode (per node, and the loss at every batch
    size), which updates batch-norm statistics in place; emit saves the model's state into the
    stage files, so a plan's weights would otherwise differ with a cold profile cache from the
    same plan compiled with a warm one (they did: ResNet's running means and counts)."""
    import torch

    from partc.cost.measured import measure_costs
    from partc.frontend.capture import capture_graph

    path = TEST_MODELS / "odd_io.py"
    result = capture_graph(path, 4, onnx=False)
    before = {n: t.detach().clone() for n, t in result.capture.model.state_dict().items()}
    assert any(n.endswith("num_batches_tracked") for n in before)  # the model has batch norm
    measure_costs(result, torch.device("cpu"), dataclasses.replace(FAST, batch_sizes=(2, 4, 8)),
                  Progress())
    after = result.capture.model.state_dict()
    changed = [n for n, t in before.items() if not torch.equal(t, after[n])]
    assert not changed, changed
    program = {n: t for n, t in result.capture.exported.state_dict.items() if n in before}
    assert program and all(torch.equal(t, before[n]) for n, t in program.items())


def test_an_entry_of_another_measurement_revision_is_not_extended(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # sizes measured two ways (say, before and after launch's allocator settings) would make
    # one curve whose slope is neither's: an entry at some of the sizes, written by a partc that
    # measured differently, is measured again at every size, not merged
    from partc.cost.measured import MEASUREMENT_REVISION

    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path))
    first, first_path, _ = _cached(dataclasses.replace(FAST, batch_sizes=(2, 4)))
    assert first.source.calibration["revision"] == MEASUREMENT_REVISION
    text = first_path.read_text()
    assert text.count(f"revision: {MEASUREMENT_REVISION}\n") == 1
    first_path.write_text(text.replace(f"revision: {MEASUREMENT_REVISION}\n",
                                       f"revision: {MEASUREMENT_REVISION - 1}\n"))
    more, _, steps = _cached(dataclasses.replace(FAST, batch_sizes=(2, 4, 16)))
    measured = " ".join(s for s in steps.steps if s.startswith("torch: "))
    assert all(f"batch {b}" in measured for b in (2, 4, 16)), measured
    assert more.source.calibration["revision"] == MEASUREMENT_REVISION
