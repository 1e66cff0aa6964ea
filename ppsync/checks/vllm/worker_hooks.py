"""What ``ppsync vllm-check`` installs in every process of the vLLM it runs.

A ``sitecustomize`` module that the check puts first on ``PYTHONPATH`` for
that run (and only that run) loads this file by its path, before vLLM is
imported, in the engine process and in each worker vLLM spawns; so this
module imports nothing from ppsync at the top (importing the package would
import torch at interpreter start-up) and nothing from vLLM until vLLM
itself loads the module a hook is for. Each part is switched on by a
variable the check sets:

- ``PPSYNC_VLLM_CHECK_STANDIN=1``: registers a stand-in ``cpu`` backend in
  Triton's backend table. vLLM's CPU build turns Triton off when that table
  has no ``cpu`` backend (the stock Triton wheel has none), and Model Runner
  V2's kernels are Triton kernels; with the stand-in present they are built,
  and ``TRITON_INTERPRET=1`` (set by the check) runs them in Triton's
  interpreter on CPU tensors. The stand-in's driver reports itself inactive,
  so Triton never picks it to compile for.
- ``PPSYNC_VLLM_CHECK_RECORD=DIR``: when vLLM's GPU model runner (which its
  CPU runner subclasses) has been built, writes which handler class it built
  to ``DIR/worker-<pid>.jsonl``, then one line per handler call vLLM
  makes per step (ppsync.compat.vllm.calls.HANDLER_CALLS) with its
  duration (and, for ``receive``, what it returned and the batch's rows).
  For ppsync's handler the first line also says which codec, kernel sets
  and completion semantics it really runs, and on the CPU twin a line
  carries the twin's counts whenever they change
  (ppsync.core.wire.completion.STATS); a call that raises writes its error
  (type, first line, time).
- ``PPSYNC_VLLM_CHECK_FAULT=ACTION:RANK:N`` (with the recording): the worker
  of PP rank RANK writes the time and sends itself ACTION (``kill``:
  SIGKILL, ``stop``: SIGSTOP) at its N-th step (the last rank's
  ``broadcast``, another rank's ``receive``), while the engine generates.
- ``PPSYNC_VLLM_CHECK_NODE=LABEL`` (``--nodes``): the worker's host, in its record
  (with GLOO_SOCKET_IFNAME, ppsync's frames); a failed build: init-error-<pid>.jsonl.
- ``PPSYNC_VLLM_CHECK_SEED=N``: after vLLM's dummy loader filled the weights
  (every tensor from the same seed, so all look alike and the tokens
  repeat), refills each floating-point tensor from a generator seeded with
  ``N`` and the tensor's name: the same weights in every run, different
  from one tensor to the next. It runs before vLLM processes the loaded
  weights (the CPU build repacks linear layers there).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_STANDIN = "PPSYNC_VLLM_CHECK_STANDIN"
ENV_RECORD = "PPSYNC_VLLM_CHECK_RECORD"
ENV_SEED = "PPSYNC_VLLM_CHECK_SEED"
ENV_MASK_CAST = "PPSYNC_VLLM_CHECK_MASK_CAST"
ENV_ASYNC = "PPSYNC_VLLM_CHECK_ASYNC_SCHEDULING"
ENV_FAULT = "PPSYNC_VLLM_CHECK_FAULT"
ENV_NODE = "PPSYNC_VLLM_CHECK_NODE"  # node_record.ENV_NODE
ENV_SLOW = "PPSYNC_VLLM_CHECK_SLOW"
FAULT_SIGNALS = {"kill": "SIGKILL", "stop": "SIGSTOP"}
TRITON_INTERPRETER = "triton.runtime.interpreter"
CPU_PLATFORM = "vllm.platforms.cpu"
GPU_MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"
DUMMY_LOADER = "vllm.model_executor.model_loader.dummy_loader"
PPSYNC_HANDLER = "ppsync.compat.vllm.handler"
PPSYNC_PLUGIN = "ppsync.compat.vllm.plugin"
NODE_RECORD = "ppsync.checks.vllm.node_record"  # imported once vLLM runs
WORKER_FAULTS = "ppsync.checks.vllm.worker_faults"  # the same
PPSYNC_CALLS = "ppsync.compat.vllm.calls"  # HANDLER_CALLS: the calls timed here


class _StandInDriver:
    """Tells vLLM a CPU backend exists; never active, so never chosen."""

    @classmethod
    def is_active(cls) -> bool:
        return False


class _StandInCompiler:
    """Never used: kernels run in Triton's interpreter."""


def register_triton_standin() -> None:
    """Put the stand-in ``cpu`` backend in Triton's table (no-op if one is there)."""
    import triton.backends as backends

    backends.backends.setdefault("cpu", backends.Backend(
        compiler=_StandInCompiler, driver=_StandInDriver))


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after the named module is executed."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch  # this spec's own loader object
        return spec


def _recorder(record_dir: Path) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        runner_cls = module.GPUModelRunner
        init = runner_cls.__init__

        def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
            t0 = time.time()
            try:
                init(self, *args, **kwargs)
            except Exception as e:  # e.g. ppsync's refusal of another node's settings
                importlib.import_module(NODE_RECORD).record_init_error(record_dir, t0, e)
                raise
            _record_handler(self, record_dir)

        runner_cls.__init__ = recording_init

    return patch


def _record_handler(runner: Any, record_dir: Path) -> None:
    from vllm.distributed.parallel_state import get_pp_group

    handler = getattr(runner, "pp_handler", None)
    group = get_pp_group()
    cls = type(handler)
    ppsync_base = importlib.import_module(PPSYNC_HANDLER).PPHandler
    ours = handler is not None and issubclass(cls, ppsync_base)
    out = (record_dir / f"worker-{os.getpid()}.jsonl").open("a", buffering=1)
    out.write(json.dumps({
        "event": "handler", "pid": os.getpid(), "pp_rank": group.rank_in_group,
        "pp_size": group.world_size, "runner": type(runner).__qualname__,
        "handler": None if handler is None else f"{cls.__module__}.{cls.__qualname__}",
        "ppsync": ours, **importlib.import_module(NODE_RECORD).node_facts(),
        **(path_facts(getattr(handler, "token_path", None)) if ours else {})
    }) + "\n")
    if handler is None:
        return
    stats = importlib.import_module("ppsync.core.wire.completion").STATS if ours else None
    if ours:  # a worker that leaves on an error (the plugin's PPSYNC_VLLM_ON_ERROR=exit)
        importlib.import_module(PPSYNC_PLUGIN).LEAVE_HOOKS.append(
            lambda call, e: write_error(out, call, e))
    last = group.rank_in_group == group.world_size - 1
    faults = importlib.import_module(WORKER_FAULTS)
    fault = faults.fault_for(group.rank_in_group, "broadcast" if last else "receive", out)
    slow = faults.slow_for(group.rank_in_group, runner.execute_model, out)
    if slow is not None:  # the worker calls its runner's execute_model by attribute
        runner.execute_model = slow
    frames = (lambda: int(handler.token_path.seq)) if ours else None
    for name in importlib.import_module(PPSYNC_CALLS).HANDLER_CALLS:
        setattr(handler, name, _timed(name, getattr(handler, name), out, stats, fault, frames))


def write_error(out: Any, call: str, e: BaseException) -> None:
    """Record a handler call's error: its time, type and first line."""
    text = str(e).splitlines()
    out.write(json.dumps({"event": "error", "call": call, "t": time.time(),
                          "type": type(e).__name__, "line": text[0] if text else ""}) + "\n")
    out.flush()


def path_facts(path: Any) -> dict[str, object]:
    """What a ppsync token path really runs: codec, kernel sets, semantics."""
    codec = path.codec
    words = importlib.import_module("ppsync.core.frame.layout").FrameLayout(
        path.config).words(path.config.max_num_reqs)
    carrier = path.config.carrier if codec.on_device else "-"
    return {"codec": path.config.codec, "carrier": carrier, "cpu_kernels": codec.kernels.name,
            "device_kernels": codec.device_kernels_name, "completion": path.completion.name,
            "frame_bytes": 8 * int(words), "token_backend": str(path.backend)}


def _timed(name: str, call: Callable[..., Any], out: Any, stats: Any = None, fault: Callable[
        [str], None] | None = None, frames: Callable[[], int] | None = None) -> Callable[..., Any]:
    seen = [(0, 0, 0)]

    def timed(*args: Any, **kwargs: Any) -> Any:
        if fault is not None:
            fault(name)
        t0 = time.perf_counter()
        try:
            result = call(*args, **kwargs)
        except Exception as e:
            write_error(out, name, e)
            raise
        seconds = time.perf_counter() - t0
        if stats is not None:
            now = (stats.engine_waits_unconsumed, stats.engine_waits_consumed, stats.side_waits)
            if now != seen[0]:
                seen[0] = now
                out.write(json.dumps({"event": "twin", "counts": list(now)}) + "\n")
        returned = f', "returned": {json.dumps(result)}' if isinstance(result, bool) else ""
        rows = getattr(args[0], "num_reqs", None) if args else None  # receive's input_batch
        if isinstance(rows, int):
            returned += f', "rows": {rows}'
        multi = rows_sampling_more(name, args, kwargs, result)  # after the timed call
        if multi is not None:
            returned += f', "multi": {multi}'
        if frames is not None and name.startswith("broadcast"):  # frames sent so far
            returned += f', "seq": {frames()}'
        out.write(f'{{"event": "{name}", "s": {seconds!r}{returned}}}\n')
        return result

    return timed


def rows_sampling_more(name: str, args: Sequence[Any], kwargs: dict[str, Any],
                       result: Any) -> int | None:
    """The rows with ``num_sampled > 1`` in a step's sampled outputs: the
    last rank's ``broadcast(sampled, num_sampled, ...)`` or what a receiver's
    ``get_prev_sampled_outputs`` returned; None for another call or one
    without outputs. Read after the call is timed (on a GPU, a copy back to
    the host per step)."""
    if name == "broadcast":
        num_sampled = kwargs.get("num_sampled", args[1] if len(args) > 1 else None)
    elif name == "get_prev_sampled_outputs" and isinstance(result, dict):
        num_sampled = result.get("num_sampled")
    else:
        return None
    if num_sampled is None or not hasattr(num_sampled, "gt"):
        return None
    return int(num_sampled.gt(1).sum().item())


def _reseeder(seed: int) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        loader_cls = module.DummyModelLoader
        load_weights = loader_cls.load_weights

        def load_and_reseed(self: Any, model: Any, model_config: Any) -> None:
            load_weights(self, model, model_config)
            reseed_weights(model, seed)

        loader_cls.load_weights = load_and_reseed

    return patch


def reseed_weights(model: Any, seed: int) -> None:
    """Refill every floating-point parameter of ``model`` from a generator
    seeded with ``seed`` and the parameter's name: 1-D tensors (norm
    weights) near 1, the others uniform with unit-variance outputs
    (bound sqrt(3 / fan_in))."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not torch.is_floating_point(param) or param.device.type == "meta":
                continue
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            u = torch.rand(param.shape, generator=gen, dtype=torch.float32) * 2 - 1
            if param.dim() == 1:
                values = 1 + 0.1 * u
            else:
                values = u * (3.0 / param.shape[-1]) ** 0.5
            param.copy_(values.to(param.dtype))


class _Workarounds:
    """Writes, once per work-around and process, where it acted."""

    def __init__(self, record_dir: Path | None) -> None:
        self.record_dir = record_dir
        self.seen: set[str] = set()

    def acted(self, name: str, detail: str) -> None:
        if name in self.seen:
            return
        self.seen.add(name)
        if self.record_dir is None:
            return
        path = self.record_dir / f"workaround-{os.getpid()}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps({"event": name, "pid": os.getpid(), "detail": detail}) + "\n")


def _bool_mask(mask: Any, tl_int1: Any, handle_cls: Any) -> Any:
    """``mask`` unchanged when its data is boolean; else a boolean copy (nonzero: true)."""
    data = mask.data
    if data.dtype == bool:
        return mask
    return handle_cls(data != 0, tl_int1)


def patch_interpreter_masks(module: ModuleType, acted: Callable[[str, str], None]) -> None:
    """Make the interpreter's masked load and store accept a non-boolean mask
    by casting it to boolean (``module``: triton.runtime.interpreter)."""
    builder, handle_cls, tl = module.InterpreterBuilder, module.TensorHandle, module.tl
    load, store = builder.create_masked_load, builder.create_masked_store

    def masked_load(self: Any, ptrs: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        cast = _bool_mask(mask, tl.int1, handle_cls)
        if cast is not mask:
            acted("mask_cast", f"load mask of dtype {mask.data.dtype}")
        return load(self, ptrs, cast, *args, **kwargs)

    def masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any,
                     **kwargs: Any) -> Any:
        cast = _bool_mask(mask, tl.int1, handle_cls)
        if cast is not mask:
            acted("mask_cast", f"store mask of dtype {mask.data.dtype}")
        return store(self, ptrs, value, cast, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store


def _async_scheduler(acted: Callable[[str, str], None]) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        platform = module.CpuPlatform
        update = platform.check_and_update_config.__func__

        def update_then_async(cls: Any, vllm_config: Any) -> None:
            sched = vllm_config.scheduler_config
            chosen = sched.async_scheduling  # vLLM's own choice (False: e.g. plain ngram)
            update(cls, vllm_config)
            if chosen and not sched.async_scheduling:
                sched.async_scheduling = True
                acted("async_scheduling", "async_scheduling turned back on after "
                      "CpuPlatform.check_and_update_config")

        platform.check_and_update_config = classmethod(update_then_async)

    return patch


def install_from_env() -> None:
    """Install what the check's variables ask for; nothing when none is set."""
    if os.environ.get(ENV_STANDIN) == "1":
        register_triton_standin()
    patches: dict[str, Callable[[ModuleType], None]] = {}
    record = os.environ.get(ENV_RECORD)
    acted = _Workarounds(Path(record) if record else None).acted
    if record:
        patches[GPU_MODEL_RUNNER] = _recorder(Path(record))
    if os.environ.get(ENV_MASK_CAST) == "1":
        patches[TRITON_INTERPRETER] = lambda module: patch_interpreter_masks(module, acted)
    if os.environ.get(ENV_ASYNC) == "1":
        patches[CPU_PLATFORM] = _async_scheduler(acted)
    seed = os.environ.get(ENV_SEED)
    if seed:
        patches[DUMMY_LOADER] = _reseeder(int(seed))
    # a module imported already is patched now (the stand-in's import of
    # Triton imports Triton's interpreter), the others when they are imported
    for name in [n for n in patches if n in sys.modules]:
        patches.pop(name)(sys.modules[name])
    if patches:
        sys.meta_path.insert(0, AfterImport(patches))
