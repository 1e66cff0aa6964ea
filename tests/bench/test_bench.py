"""``ppsync bench``: tiny runs on real gloo ranks check the report's structure
(tables, JSON keys, ratios present and positive). Benchmarks are not tests:
nothing here asserts a timing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ppsync.bench.runner import BenchOptions, BenchReport, format_tables, run_bench
from ppsync.bench.stats import overdue_within
from ppsync.cli import main
from ppsync.errors import ConfigError

TINY = ["--rows", "8", "--iters", "30", "--pipelined-iters", "60", "--warmup", "6",
        "--compute-us", "50", "--timeout", "20"]
LOCK_VARIANTS = ["a_raw_frame", "b_vllm", "c_ppsync_sync", "d_ppsync_async"]
SCHEMES = ["vllm", "ppsync_sync", "ppsync_async"]
RATIO_KEYS = {"c/a", "c/b", "d/a", "d/b", "sync/vllm step", "sync/vllm blocked",
              "async/vllm step", "async/vllm blocked"}


def _check_report(report: BenchReport, groups: list[str]) -> None:
    o = report.options
    assert [(s.variant, s.group) for s in report.lockstep] == [
        (v, g) for g in groups for v in LOCK_VARIANTS
    ]
    assert [(s.variant, s.group) for s in report.pipelined] == [
        (v, g) for g in groups for v in SCHEMES
    ]
    for s in report.lockstep:
        assert 0 < s.span_p50_us <= s.span_p99_us
        assert s.last_p50_us > 0 and s.receiver_p50_us > 0
    for p in report.pipelined:
        # a step spins compute_us, so its wall time cannot be shorter
        assert p.step_p50_us >= o.compute_us and p.blocked_p50_us > 0
        if p.variant == "vllm":
            assert p.complete_at_consume is None
        else:
            assert p.complete_at_consume is not None and 0 <= p.complete_at_consume <= 1
        has_lag = p.variant == "ppsync_async"
        assert (p.lag_p99_us is not None) == has_lag
        assert (p.lag_raw_p99_us is not None) == has_lag
    assert report.ratios.keys() >= RATIO_KEYS
    assert all(v > 0 for v in report.ratios.values()), report.ratios
    assert all(v > 0 for v in report.cpu.model_dump().values()), report.cpu
    assert report.frame_words == 8 + o.rows * (2 * o.spec + 5)  # header + [rows, L + 4 + K]
    assert report.slot_us >= 500
    assert {t.name for t in report.targets} >= {
        "lockstep c/b", "lockstep c/a", "lockstep d/a", "pipelined sync/vllm step",
        "own CPU last rank / vLLM's (hot)", "own CPU receiver / vLLM's (hot)",
        "own CPU receiver us (pipelined)", "loop lag p99 added over idle us"}
    assert report.idle_lag_p99_us > 0
    assert all(t.met == (t.value <= t.limit) for t in report.targets)


def test_cli_bench_prints_tables_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--pp-size", "2", *TINY, "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for head in ("lockstep: P=2 rows=8 K=0", "pipelined: P=2 rows=8 K=0", "span_p50",
                 "recv_p50", "step_p50", "blk_p50", "done@cons", "lag_p99", "own CPU per step",
                 "loop lag p99", "torch calls per step", "an idle loop's lag p99",
                 "vLLM's scheme's host calls", "flight recorder per step", "targets"):
        assert head in text, head
    for name in LOCK_VARIANTS + SCHEMES:
        assert re.search(rf"^{name}\s+dedicated\s+\d", text, re.M), name
    for ratio in ("c/a", "c/b", "d/a"):
        m = re.search(rf"{re.escape(ratio)} (\d+\.\d+)", text)
        assert m is not None and float(m.group(1)) > 0, ratio

    data = json.loads(out_json.read_text())
    assert set(data) == set(BenchReport.model_fields)
    assert data["options"]["pp_size"] == 2 and data["options"]["rows"] == 8
    report = BenchReport.model_validate(data)
    _check_report(report, ["dedicated"])
    # set for P=2, 256 rows: not printed for 8 rows; for theirs, said to be goals
    assert not report.reference_config and "targets: not printed" in text
    assert "MISSED" not in text and " met\n" not in text
    at_reference = format_tables(report.model_copy(update={"reference_config": True}))
    assert "goals set for P=2, 256 rows" in at_reference and "never checked" in at_reference
    assert all(t.name in at_reference for t in report.targets)


def test_bench_three_ranks_with_drafts() -> None:
    opts = BenchOptions(pp_size=3, rows=4, spec=3, iters=20, pipelined_iters=50, warmup=4,
                        compute_us=30, timeout_s=20)
    report = run_bench(opts)
    _check_report(report, ["dedicated"])
    assert "K=3" in format_tables(report)


def test_bench_hidden_runs_on_both_groups() -> None:
    opts = BenchOptions(pp_size=2, rows=4, iters=12, pipelined_iters=40, warmup=4,
                        compute_us=30, hidden=(4, 64), timeout_s=20)
    report = run_bench(opts)
    _check_report(report, ["dedicated", "world"])
    assert {"c/a@world", "sync/vllm step@world", "c world/dedicated",
            "ppsync_sync step world/dedicated"} <= report.ratios.keys()
    text = format_tables(report)
    assert "ratios on the world group" in text and "world group vs dedicated" in text


def test_cli_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--hidden", "1024"])
    assert exc.value.code == 2
    assert "ROWSxHIDDEN" in capsys.readouterr().err
    assert main(["bench", "--rows", "8", "--max-num-reqs", "4"]) == 2
    assert "ppsync: --max-num-reqs = 4 must be >= --rows = 8" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="pp_size"):
        BenchOptions.build(pp_size=1)
    with pytest.raises(SystemExit) as exc:  # bounded at parsing, from BenchOptions.pp_size
        main(["bench", "--pp-size", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ppsync bench: error: argument --pp-size: 1 must be in [2, 64]"], err


def test_overdue_within_counts_only_lateness_inside_windows() -> None:
    starts = np.array([10, 30], dtype=np.int64)
    ends = np.array([20, 40], dtype=np.int64)
    due = np.array([15, 0, 22, 35, 45, 12], dtype=np.int64)
    woke = np.array([35, 50, 28, 38, 60, 11], dtype=np.int64)  # the last woke early
    got = overdue_within(due, woke, starts, ends)
    assert got.tolist() == [10, 20, 0, 3, 0, 0]
    none = np.array([], dtype=np.int64)
    assert overdue_within(due, woke, none, none).tolist() == [0] * 6
