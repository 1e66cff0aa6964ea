"""``ppsync vllm-check`` without vLLM: its arguments, its refusal (exit 2,
pointing at ``make vllm-check``) where vLLM is not installed, the
comparison and the report, the worker records, the per-tensor reseeding and
the after-import hook its worker processes use. The check itself runs vLLM:
``make vllm-check``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ppsync.cli import _parser, main
from ppsync.harness.vllm_check import check, worker_hooks
from ppsync.harness.vllm_check.report import (
    RunResult,
    WorkerRecord,
    failures,
    format_report,
    read_worker_records,
    token_differences,
)

VLLM_HANDLER = "vllm.v1.worker.gpu.pp_utils.PPHandler"
OURS = "ppsync.compat.vllm.plugin.VllmPPHandler032"
TOKENS = (((5, 6, 7), (8, 9, 10)),)


def _workers(ppsync: bool, handler: str, ranks: tuple[int, ...] = (0, 1)) -> tuple[
        WorkerRecord, ...]:
    return tuple(WorkerRecord(pid=100 + r, pp_rank=r, pp_size=2, runner="CPUModelRunner",
                              handler=handler, ppsync=ppsync,
                              receive_s=(0.001, 0.003) if r == 0 else (),
                              broadcast_s=(0.002,) if r == 1 else (),
                              prev_s=(0.004,), receive_rows=(4, 2, 4) if r == 0 else ())
                 for r in ranks)


def _runs(ours_workers: tuple[WorkerRecord, ...] | None = None,
          ours_tokens: tuple[tuple[tuple[int, ...], ...], ...] = TOKENS,
          ) -> tuple[RunResult, RunResult]:
    base = RunResult("vLLM's PPHandler", False, _workers(False, VLLM_HANDLER), TOKENS, (1.5,))
    ours = RunResult("ppsync's plugin", True,
                     _workers(True, OURS) if ours_workers is None else ours_workers,
                     ours_tokens, (1.25,))
    return base, ours


def test_arguments_and_defaults() -> None:
    args = _parser().parse_args(["vllm-check"])
    assert (args.pp_size, args.prompts, args.max_tokens, args.repeat, args.seed) == (
        2, 4, 12, 2, 0)
    with pytest.raises(SystemExit):
        _parser().parse_args(["vllm-check", "--pp-size", "1"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["vllm-check", "--max-tokens", "0"])


def test_no_vllm_exits_2_naming_make_target(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(check, "installed_vllm_version", lambda: None)
    assert main(["vllm-check"]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "make vllm-check" in err
    assert sys.executable in err


def test_hidden_must_be_multiple_of_head_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-check", "--hidden", "100"]) == 2
    assert "--hidden = 100 must be a multiple of 32" in capsys.readouterr().err


def test_pass_report() -> None:
    base, ours = _runs()
    assert failures(base, ours, 2) == []
    text = format_report(base, ours, 2, header=["head"])
    assert text.startswith("head")
    assert "tokens: identical (1 generate calls x 2 prompts, 3 tokens each)" in text
    assert f"ppsync's plugin: PP rank 0/2 (pid 100, CPUModelRunner): {OURS} [ppsync]" in text
    assert "PPHandler.receive (non-last ranks): 2 calls: mean 2.000 ms, median 2.000 ms" in text
    assert "generate: 1.25 s" in text
    assert "in 0; rows per call: 4 x2, 2 x1" in text
    assert "get_prev_sampled_outputs (non-last ranks): 1 calls: mean 4.000 ms" in text
    assert text.splitlines()[-1].startswith("PASS: ppsync's handler was built in all 2 workers")


def test_fails_when_a_worker_kept_vllms_handler() -> None:
    mixed = _workers(True, OURS, (0,)) + _workers(False, VLLM_HANDLER, (1,))
    base, ours = _runs(ours_workers=mixed)
    why = failures(base, ours, 2)
    assert why == [f"ppsync's plugin: worker pid 101 (PP rank 1) built {VLLM_HANDLER}, "
                   "not ppsync's PPHandler"]
    assert "\nFAIL\n" in format_report(base, ours, 2)


def test_fails_when_a_rank_recorded_nothing() -> None:
    base, ours = _runs(ours_workers=_workers(True, OURS, (0,)))
    assert failures(base, ours, 2) == [
        "ppsync's plugin: handler records from PP ranks [0], expected 0..1 (a worker that "
        "built no model runner, or whose hook did not load)"]


def test_fails_when_tokens_differ() -> None:
    base, ours = _runs(ours_tokens=(((5, 6, 7), (8, 11, 10)),))
    assert token_differences(base, ours) == [
        "call 0 prompt 1: first difference at token 1 ([9, 10] against [11, 10]; "
        "3 and 3 tokens)"]
    assert "tokens: DIFFER" in format_report(base, ours, 2)
    assert len(failures(base, ours, 2)) == 1


def test_unfinished_run_is_reported_not_compared() -> None:
    base, ours = _runs()
    broken = RunResult(ours.label, True, error="exit status 1")
    assert failures(base, broken, 2)[0] == "ppsync's plugin: did not finish: exit status 1"
    assert "tokens: not compared" in format_report(base, broken, 2)


def test_read_worker_records(tmp_path: Path) -> None:
    head = {"event": "handler", "pid": 7, "pp_rank": 1, "pp_size": 2, "runner": "R",
            "handler": OURS, "ppsync": True}
    (tmp_path / "worker-7.jsonl").write_text(
        json.dumps(head) + '\n{"event": "broadcast", "s": 0.5}\n'
        '{"event": "receive", "s": 0.25, "returned": true, "rows": 3}\n'
        '{"event": "receive", "s": 0.75, "returned": false}\n'
        '{"event": "get_prev_sampled_outputs", "s": 0.125}\n{"event": "rece')
    (tmp_path / "worker-8.jsonl").write_text('{"event": "receive", "s": 1.0}\n')  # no head
    (w,) = read_worker_records(tmp_path)
    assert (w.pid, w.pp_rank, w.handler, w.ppsync, w.broadcast_s, w.receive_s) == (
        7, 1, OURS, True, (0.5,), (0.25, 0.75))
    assert (w.receive_all_rows, w.prev_s, w.receive_rows) == (1, (0.125,), (3,))


def test_prompts_and_config_follow_options() -> None:
    opts = check.VllmCheckOptions(prompts=3, seed=5, hidden=64, layers_per_stage=1)
    assert check.prompt_ids(opts) == check.prompt_ids(opts)
    assert len(check.prompt_ids(opts)) == 3
    assert all(3 <= t < 512 for p in check.prompt_ids(opts) for t in p)
    cfg = check.model_config(opts)
    assert (cfg["num_hidden_layers"], cfg["head_dim"], cfg["num_attention_heads"]) == (2, 32, 2)


def test_reseed_is_per_tensor_and_repeatable() -> None:
    def model() -> tuple[torch.nn.Module, torch.nn.Linear, torch.nn.Linear, torch.nn.LayerNorm]:
        first, second = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
        norm = torch.nn.LayerNorm(8)
        return torch.nn.Sequential(first, second, norm), first, second, norm

    torch.manual_seed(0)
    a, first, second, norm = model()
    b = model()[0]
    worker_hooks.reseed_weights(a, 3)
    worker_hooks.reseed_weights(b, 3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(first.weight, second.weight)
    assert first.weight.abs().max() <= (3 / 8) ** 0.5
    assert (norm.weight - 1).abs().max() <= 0.1


def test_after_import_hook_patches_the_named_module(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "vc_hooked_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def patch(module: ModuleType) -> None:
        module.VALUE = module.VALUE + 41  # type: ignore[attr-defined]

    hook = worker_hooks._AfterImport({"vc_hooked_mod": patch})
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "vc_hooked_mod", raising=False)
    import vc_hooked_mod  # type: ignore[import-not-found]

    assert vc_hooked_mod.VALUE == 42
    monkeypatch.delitem(sys.modules, "vc_hooked_mod")
