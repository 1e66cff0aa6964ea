"""``ppsync vllm-check`` without vLLM: its arguments, its refusal (exit 2,
pointing at ``make vllm-check``) where vLLM is not installed, the
comparison and the report (speculative decoding's verdicts, per rank at PP
3), the worker records, the per-tensor reseeding, the after-import hook its
worker processes use, and the two vLLM-side work-arounds on stand-ins (the
mask cast also in Triton's own interpreter, where Triton is installed). The check itself runs vLLM:
``make vllm-check``."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from ppsync.checks.vllm import check, engine, worker_hooks
from ppsync.checks.vllm.report import (
    RunResult,
    SpecFigures,
    WorkerRecord,
    failures,
    format_report,
    read_workarounds,
    read_worker_records,
    spec_figures,
    token_differences,
)
from ppsync.cli import main
from ppsync.cli.parser import _parser
from ppsync.compat.vllm.calls import HANDLER_CALLS
from ppsync.compat.vllm.handler import PPHandler

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
    assert (args.pp_size, args.prompts, args.max_tokens, args.calls, args.repeat, args.seed) == (
        2, 4, None, None, 1, 0)
    assert (args.codec, args.emulate, args.fault, args.handler_timeout) == (None, None, None, None)
    assert (args.spec, args.spec_method) == (0, "ngram_gpu")
    args = _parser().parse_args(["vllm-check", "--spec", "3", "--spec-method", "ngram",
                                 "--pp-size", "3"])
    assert (args.spec, args.spec_method, args.pp_size) == (3, "ngram", 3)
    with pytest.raises(SystemExit):
        _parser().parse_args(["vllm-check", "--spec", "-1"])
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
    assert "      receive: 2 calls: mean 2.000 ms, median 2.000 ms" in text
    assert "ppsync's plugin: generate 1.25 s" in text
    assert "in 0; rows per call: 4 x2, 2 x1" in text
    assert "      get_prev_sampled_outputs: 1 calls: mean 4.000 ms" in text
    assert "    PP rank 1/2 (last, pid 101):\n      broadcast: 1 calls: mean 2.000 ms" in text
    assert "num_sampled" not in text and "speculative" not in text  # K = 0
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


def test_each_handler_call_the_hooks_time_reaches_the_worker_record(tmp_path: Path) -> None:
    # the hooks time every call of HANDLER_CALLS; a call added there must not
    # be timed and then dropped by the report
    head = {"event": "handler", "pid": 7, "pp_rank": 0, "pp_size": 2, "runner": "R",
            "handler": OURS, "ppsync": True}
    durations = {call: 2.0 ** -i for i, call in enumerate(HANDLER_CALLS)}
    (tmp_path / "worker-7.jsonl").write_text("\n".join(
        json.dumps(e) for e in [head, *({"event": c, "s": s} for c, s in durations.items())]))
    (w,) = read_worker_records(tmp_path)
    timed = [s for f in dataclasses.fields(w) if f.name.endswith("_s")
             for s in getattr(w, f.name)]
    assert sorted(timed) == sorted(durations.values())
    assert all(callable(getattr(PPHandler, call)) for call in HANDLER_CALLS)


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

    hook = worker_hooks.AfterImport({"vc_hooked_mod": patch})
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "vc_hooked_mod", raising=False)
    import vc_hooked_mod  # type: ignore[import-not-found]

    assert vc_hooked_mod.VALUE == 42
    monkeypatch.delitem(sys.modules, "vc_hooked_mod")


# speculative decoding, PP 3, the work-around hooks, where vLLM came from

SPEC_OK = SpecFigures(drafts=142, draft_tokens=426, accepted=110, per_position=(60, 35, 15))


def _spec_runs(base_spec: SpecFigures | None = SPEC_OK,
               ours_spec: SpecFigures | None = SPEC_OK) -> tuple[RunResult, RunResult]:
    base, ours = _runs()
    return (dataclasses.replace(base, spec=base_spec),
            dataclasses.replace(ours, spec=ours_spec, workarounds={"mask_cast": 2}))


def test_spec_options_reach_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[check.VllmCheckOptions] = []

    def run_check(opts: check.VllmCheckOptions) -> int:
        seen.append(opts)
        return 0

    monkeypatch.setattr("ppsync.checks.vllm.run_check", run_check)
    assert main(["vllm-check", "--spec", "3", "--pp-size", "3"]) == 0
    assert main(["vllm-check", "--spec", "2", "--spec-method", "ngram", "--max-tokens", "7"]) == 0
    assert main(["vllm-check"]) == 0
    assert [(o.spec, o.spec_method, o.pp_size, o.max_tokens) for o in seen] == [
        (3, "ngram_gpu", 3, 32), (2, "ngram", 2, 7), (0, "ngram_gpu", 2, 12)]


def test_spec_prompts_repeat_a_short_pattern() -> None:
    prompts = check.prompt_ids(check.VllmCheckOptions(prompts=6, seed=2, spec=3))
    assert len(prompts) == 6
    for p in prompts:
        assert 8 <= len(p) <= 15 and all(3 <= t < 512 for t in p)
        period = next(n for n in range(2, 5) if p[n:] == p[:-n])
        assert len(set(p[:period])) >= 1 and period <= 4


def test_spec_pass_report_has_vllms_acceptance_figures() -> None:
    base, ours = _spec_runs()
    assert failures(base, ours, 2, spec=3) == []
    text = format_report(base, ours, 2, spec=3)
    assert ("ppsync's plugin: 142 drafts, 426 draft tokens, 110 accepted (25.8% of draft "
            "tokens); accepted per position: 60, 35, 15") in text
    assert "broadcast_drafts: -" in text
    assert "get_prev_sampled_outputs (scatters drafts into the draft table)" in text
    assert "work-arounds that acted: ppsync's plugin: mask_cast in 2 processes" in text
    assert text.splitlines()[-1].endswith("(K=3; drafts accepted in both runs: 110 and 110 "
                                          "tokens)")


@pytest.mark.parametrize("spec", [SpecFigures(5, 15, 0), None, SpecFigures(5, 15, None)])
def test_no_draft_accepted_fails_saying_the_draft_path_was_not_tested(
        spec: SpecFigures | None) -> None:
    base, ours = _spec_runs(ours_spec=spec)
    (why,) = failures(base, ours, 2, spec=3)
    assert why.startswith("ppsync's plugin: ") and "the draft path was not tested" in why
    assert "\nFAIL\n" in format_report(base, ours, 2, spec=3)
    assert failures(base, ours, 2, spec=0) == []  # K = 0 asks for no draft


def test_per_rank_report_at_pp_3_with_a_middle_rank() -> None:
    workers = tuple(WorkerRecord(
        pid=200 + r, pp_rank=r, pp_size=3, runner="R", handler=OURS, ppsync=True,
        receive_s=(0.001,) if r < 2 else (), broadcast_s=(0.002,) if r == 2 else (),
        drafts_s=(0.0005,) if r == 2 else (), steps=20, multi_steps=tuple(range(0, 28, 2)))
        for r in range(3))
    base, ours = _runs()
    base = dataclasses.replace(base, workers=tuple(dataclasses.replace(w, handler=VLLM_HANDLER,
                                                                       ppsync=False)
                                                   for w in workers), spec=SPEC_OK)
    ours = dataclasses.replace(ours, workers=workers, spec=SPEC_OK)
    assert failures(base, ours, 3, spec=2) == []
    text = format_report(base, ours, 3, spec=2)
    assert "    PP rank 1/3 (middle, pid 201):\n      receive: 1 calls" in text
    assert "    PP rank 2/3 (last, pid 202):\n      broadcast: 1 calls" in text
    assert "      broadcast_drafts: 1 calls: mean 0.500 ms" in text
    assert ("steps whose received outputs had a row with num_sampled > 1: 14 of 20 "
            "(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, ...)") in text
    assert "PASS: ppsync's handler was built in all 3 workers" in text
    blind = (*workers[:1], dataclasses.replace(workers[1], multi_steps=()), *workers[2:])
    assert failures(base, dataclasses.replace(ours, workers=blind), 3, spec=2) == [
        "ppsync's plugin: vLLM accepted drafts but PP rank 1's handler saw no step with a row "
        "of num_sampled > 1"]
    assert failures(base, dataclasses.replace(ours, workers=workers[:2]), 3)[0].endswith(
        "from PP ranks [0, 1], expected 0..2 (a worker that built no model runner, or whose "
        "hook did not load)")


def test_records_of_spec_steps_and_workarounds(tmp_path: Path) -> None:
    head = {"event": "handler", "pid": 9, "pp_rank": 0, "pp_size": 2, "runner": "R",
            "handler": OURS, "ppsync": True}
    (tmp_path / "worker-9.jsonl").write_text("\n".join(json.dumps(e) for e in [
        head, {"event": "get_prev_sampled_outputs", "s": 0.1},
        {"event": "get_prev_sampled_outputs", "s": 0.1, "multi": 0},
        {"event": "get_prev_sampled_outputs", "s": 0.1, "multi": 2},
        {"event": "broadcast_drafts", "s": 0.25}]) + "\n")
    (tmp_path / "workaround-9.jsonl").write_text(
        '{"event": "mask_cast"}\n{"event": "async_scheduling"}\n{"event": "mask_cast"}\n')
    (tmp_path / "workaround-10.jsonl").write_text('{"event": "mask_cast"}\n{"event": ')
    (w,) = read_worker_records(tmp_path)
    assert (w.steps, w.multi_steps, w.drafts_s, len(w.prev_s)) == (2, (1,), (0.25,), 3)
    assert read_workarounds(tmp_path) == {"mask_cast": 2, "async_scheduling": 1}


def test_rows_sampling_more_reads_broadcast_and_received_outputs() -> None:
    num = torch.tensor([1, 3, 2, 1], dtype=torch.int32)
    assert worker_hooks.rows_sampling_more("broadcast", (None, num, None, None), {}, None) == 2
    assert worker_hooks.rows_sampling_more("get_prev_sampled_outputs", (), {},
                                           {"num_sampled": num[:1]}) == 0
    assert worker_hooks.rows_sampling_more("get_prev_sampled_outputs", (), {}, None) is None
    assert worker_hooks.rows_sampling_more("receive", (num,), {}, True) is None


def test_engine_spec_config_and_counters() -> None:
    assert engine.speculative_config(0, "ngram_gpu") is None
    assert engine.speculative_config(3, "ngram_gpu") == {
        "method": "ngram_gpu", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 3}
    assert engine.speculative_config(2, "eagle3") == {"method": "eagle3",
                                                      "num_speculative_tokens": 2}
    metrics = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=7),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=4),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                               values=[3, 1]),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                               values=[1, 0, 2]),
               SimpleNamespace(name="vllm:other", value=1)]
    figures = engine.spec_figures(metrics)
    assert figures == {"drafts": 7, "accepted": 4, "accepted_per_position": [4, 1, 2]}
    assert spec_figures(figures) == SpecFigures(7, None, 4, (4, 1, 2))
    assert spec_figures(None) is None


@pytest.mark.parametrize(("spec", "standin", "cpu", "want"), [
    (0, True, True, []), (3, True, False, []), (3, False, False, []),
    (3, True, True, ["mask_cast", "async_scheduling"]), (3, False, True, ["async_scheduling"])])
def test_workarounds_only_on_cpu_with_spec(spec: int, standin: bool, cpu: bool,
                                           want: list[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    opts = check.VllmCheckOptions(spec=spec)
    assert check.workarounds(opts, standin=standin, cpu=cpu) == want
    monkeypatch.setenv(worker_hooks.ENV_ASYNC, "1")  # inherited: never passed on unasked
    env = check._base_env(tmp_path, opts, standin, cpu)
    assert env.get(worker_hooks.ENV_MASK_CAST) == ("1" if "mask_cast" in want else None)
    assert env.get(worker_hooks.ENV_ASYNC) == ("1" if "async_scheduling" in want else None)


def _standin_interpreter() -> ModuleType:
    """A stand-in for triton.runtime.interpreter whose masked load and store,
    as Triton 3.9's, refuse a mask that is not boolean."""
    module = ModuleType("standin_interpreter")

    class TensorHandle:
        def __init__(self, data: np.ndarray, dtype: object) -> None:
            self.data, self.dtype = data, dtype

    class InterpreterBuilder:
        def create_masked_load(self, ptrs: TensorHandle, mask: TensorHandle, other: object,
                               cache_policy: object, is_volatile: bool) -> np.ndarray:
            if mask.data.dtype != bool:
                raise ValueError("mask has unsupported dtype")
            return np.where(mask.data, ptrs.data, -1)

        def create_masked_store(self, ptrs: TensorHandle, value: TensorHandle,
                                mask: TensorHandle, cache_policy: object) -> np.ndarray:
            if mask.data.dtype != bool:
                raise ValueError("mask has unsupported dtype")
            return np.where(mask.data, value.data, ptrs.data)

    module.TensorHandle = TensorHandle  # type: ignore[attr-defined]
    module.InterpreterBuilder = InterpreterBuilder  # type: ignore[attr-defined]
    module.tl = SimpleNamespace(int1="int1")  # type: ignore[attr-defined]
    return module


def test_mask_cast_hook_on_a_standin_interpreter() -> None:
    module = _standin_interpreter()
    handle, builder_cls = module.TensorHandle, module.InterpreterBuilder
    ptrs = handle(np.arange(4), None)
    int_mask = handle(np.array([1, 1, 0, 2], dtype=np.int32), "int32")
    with pytest.raises(ValueError, match="unsupported dtype"):
        builder_cls().create_masked_load(ptrs, int_mask, None, None, False)
    acted: list[tuple[str, str]] = []
    worker_hooks.patch_interpreter_masks(module, lambda n, d: acted.append((n, d)))
    b = builder_cls()
    assert b.create_masked_load(ptrs, int_mask, None, None, False).tolist() == [0, 1, -1, 3]
    stored = b.create_masked_store(ptrs, handle(np.full(4, 9), None), int_mask, None)
    assert stored.tolist() == [9, 9, 2, 9]
    assert acted == [("mask_cast", "load mask of dtype int32"),
                     ("mask_cast", "store mask of dtype int32")]
    acted.clear()
    bool_mask = handle(np.array([True, False, True, True]), "int1")
    assert b.create_masked_load(ptrs, bool_mask, None, None, False).tolist() == [0, -1, 2, 3]
    assert acted == []  # a boolean mask is passed as it is


def test_mask_cast_hook_on_tritons_interpreter(tmp_path: Path) -> None:
    """Triton's own interpreter, in a child process: a mask made of a tensor
    comparison and a scalar one, as vLLM's ngram_gpu finalize kernel makes it,
    fails without the hook and loads and stores right with it."""
    pytest.importorskip("triton")
    kernel = tmp_path / "kernel.py"
    kernel.write_text(MASK_KERNEL.format(hooks=str(Path(worker_hooks.__file__).resolve())))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    plain = subprocess.run([sys.executable, str(kernel), "0"], env=env, capture_output=True,
                           text=True, timeout=120, check=False)
    assert plain.returncode != 0 and "mask has unsupported dtype" in plain.stderr
    hooked = subprocess.run([sys.executable, str(kernel), "1"], env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert hooked.returncode == 0, hooked.stderr
    assert hooked.stdout.split() == ["[0,1,2,3,4,-1,-1,-1]", "mask_cast"]


MASK_KERNEL = '''\
import importlib.util, sys
if sys.argv[1] == "1":
    spec = importlib.util.spec_from_file_location("hooks", {hooks!r})
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    import triton.runtime.interpreter as ti
    acted = []
    hooks.patch_interpreter_masks(ti, lambda name, detail: acted.append(name))
import torch, triton, triton.language as tl

@triton.jit
def k(src, dst, n, limit, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = n < limit
    mask = (i < n) & ok & (i < BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=mask, other=0), mask=mask)

src, dst = torch.arange(8), torch.full((8,), -1)
k[(1,)](src, dst, 5, 7, BLOCK=8)
print(str(dst.tolist()).replace(" ", ""))
print(*sorted(set(acted)))
'''


def test_async_scheduling_hook_on_a_standin_platform() -> None:
    module = ModuleType("standin_cpu_platform")

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config: SimpleNamespace) -> None:
            vllm_config.scheduler_config.async_scheduling = False  # as vllm/platforms/cpu.py

    module.CpuPlatform = CpuPlatform  # type: ignore[attr-defined]
    acted: list[str] = []
    worker_hooks._async_scheduler(lambda name, detail: acted.append(name))(module)
    chosen = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))
    CpuPlatform.check_and_update_config(chosen)
    assert chosen.scheduler_config.async_scheduling is True and acted == ["async_scheduling"]
    refused = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False))
    CpuPlatform.check_and_update_config(refused)  # vLLM's own choice (plain ngram) stays
    assert refused.scheduler_config.async_scheduling is False and acted == ["async_scheduling"]


def test_hooks_patch_a_module_imported_before_them(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in backend imports Triton (and its interpreter) before the
    after-import hook is in place: such a module is patched at once."""
    monkeypatch.setenv(worker_hooks.ENV_MASK_CAST, "1")
    monkeypatch.setenv(worker_hooks.ENV_RECORD, str(tmp_path))
    for name in (worker_hooks.ENV_STANDIN, worker_hooks.ENV_SEED, worker_hooks.ENV_ASYNC):
        monkeypatch.delenv(name, raising=False)
    module = _standin_interpreter()
    monkeypatch.setitem(sys.modules, worker_hooks.TRITON_INTERPRETER, module)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    worker_hooks.install_from_env()
    handle = module.TensorHandle
    out = module.InterpreterBuilder().create_masked_load(
        handle(np.arange(2), None), handle(np.array([0, 1], dtype=np.int32), None), None,
        None, False)
    assert out.tolist() == [-1, 1]
    (line,) = (tmp_path / f"workaround-{os.getpid()}.jsonl").read_text().splitlines()
    assert json.loads(line)["event"] == "mask_cast"


def test_vllm_origin_names_the_distribution_and_source(monkeypatch: pytest.MonkeyPatch) -> None:
    def dist(direct: dict[str, object] | None) -> SimpleNamespace:
        return SimpleNamespace(version="0.34.0", read_text=lambda name: (
            None if direct is None else json.dumps(direct)))

    cases = [
        (None, "vllm 0.34.0 from a package index (pip records no URL for it)"),
        ({"url": "file:///w/vllm-0.34.0-cp311-linux_x86_64.whl", "archive_info": {}},
         "vllm 0.34.0 from the file /w/vllm-0.34.0-cp311-linux_x86_64.whl"),
        ({"url": "file:///src/vllm", "dir_info": {"editable": True}},
         "vllm 0.34.0 from the source tree /src/vllm (editable)"),
        ({"url": "https://github.com/vllm-project/vllm", "vcs_info": {
            "vcs": "git", "commit_id": "abc"}},
         "vllm 0.34.0 from git https://github.com/vllm-project/vllm@abc"),
    ]
    for direct, want in cases:
        monkeypatch.setattr(importlib.metadata, "distribution",
                            lambda name, d=direct: dist(d))
        assert check.vllm_origin() == want


LINGERING = '''\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(float(sys.argv[2]))
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"  # a zombie waiting for its parent to reap it is gone


@pytest.mark.parametrize(("sleep_s", "timeout_s", "want"), [(120.0, 3.0, None), (0.0, 60.0, 0)])
def test_a_run_leaves_no_process_behind(tmp_path: Path, sleep_s: float, timeout_s: float,
                                        want: int | None) -> None:
    """A vLLM run that hangs, or ends leaving its engine core behind: the
    check kills every process the run started (a real child and grandchild)."""
    script, pid_file = tmp_path / "run.py", tmp_path / "pid"
    script.write_text(LINGERING)
    with (tmp_path / "log").open("w") as out:
        rc = check.run_bounded([sys.executable, str(script), str(pid_file), str(sleep_s)],
                               dict(os.environ), out, tmp_path, timeout_s)
    assert rc == want
    grandchild = int(pid_file.read_text())
    for _ in range(100):
        if not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(grandchild)
