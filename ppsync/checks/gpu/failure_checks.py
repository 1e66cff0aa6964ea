"""``make gpu-check``'s one-GPU checks of NCCL's failure path (j-l), each on a
one-rank NCCL token group, in a fresh process of its own (the
table: ppsync.checks.gpu.check):

j) ``Work.exception()`` on this torch (TypeError before PyTorch PR #184697)
   and ppsync's completion of the same work; ppsync never calls it.
k) a broadcast queued behind ``torch.cuda._sleep``, then ppsync's abort of
   the group: what ``is_completed()`` and ``wait()`` say after it, how long
   the abort held the caller and how long NCCL's abort ran, and that
   ppsync's completion counts the work failed with the abort's cause.
l) ``is_completed()`` µs per call, on a completed and on a pending work.
(m, a CUDA graph captured while a pending work is polled, and the shared
helpers' users: ppsync.checks.gpu.capture_check.)

Each probe returns what it saw (a dict) and a ``*_verdict`` judges it; the
probes also run on CPU over gloo (the tests' dry run), where nothing stays
pending: there the verdicts say the premise is false.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ppsync.checks.gpu.stream_checks import carrier_over, decode_view, device_of, long_kernel
from ppsync.core.frame.rows import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.completion import Completion, completion_for
from ppsync.core.wire.groups import token_group
from ppsync.errors import SyncTimeout
from ppsync.schemas.config import SyncConfig

TIMEOUT_S = 30.0
Result = dict[str, Any]


@contextlib.contextmanager
def one_rank_group(backend: str) -> Iterator[tuple[dist.ProcessGroup, Completion]]:
    """A one-rank world in this process (gloo, an in-process store) and its
    token group on ``backend``, with ppsync's completion for NCCL's
    semantics (the CPU dry run: a gloo group judged as NCCL's)."""
    dist.init_process_group("gloo", store=dist.HashStore(),  # type: ignore[attr-defined]
                            rank=0, world_size=1)
    try:
        group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                            backend=backend)
        yield group, completion_for(group, "nccl")
    finally:
        with contextlib.suppress(Exception):  # an aborted group may refuse
            dist.destroy_process_group()


def issued(group: dist.ProcessGroup, dev: torch.device, behind_s: float) -> tuple[
        dist.Work, torch.Tensor]:
    """A broadcast issued behind ``behind_s`` of kernel on the current stream
    (0: none), after a first one that made the communicator."""
    buf = torch.arange(64, dtype=torch.int64, device=dev)
    first = dist.broadcast(buf, src=0, group=group, async_op=True)
    assert first is not None
    first.wait()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    long_kernel(dev, behind_s)
    work = dist.broadcast(buf, src=0, group=group, async_op=True)
    assert work is not None
    return work, buf


def _outcome(fn: Callable[[], object], bound_s: float = 10.0) -> str:
    """What ``fn()`` did, as text: "returned X", "raised T: msg", or "did not
    return within N s" (it runs on a daemon thread: it may block)."""
    said: list[str] = []

    def run() -> None:
        try:
            said.append(f"returned {fn()!r}")
        except Exception as e:
            said.append(f"raised {type(e).__name__}: {' '.join(str(e).split())[:120]}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound_s)
    return said[0] if said else f"did not return within {bound_s:.0f} s"


def until_completed(work: dist.Work, bound_s: float = 10.0) -> bool:
    deadline = time.monotonic() + bound_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


# -- j) Work.exception() and ppsync's completion -----------------------------------------


@contextlib.contextmanager
def counting_calls(classes: list[type], name: str, calls: list[str]) -> Iterator[None]:
    """Every call of method ``name`` on instances of ``classes`` appends to
    ``calls``: each class in their MROs that defines it is wrapped, once."""
    owners = dict.fromkeys(c for cls in classes for c in cls.__mro__ if name in c.__dict__)
    saved = [(cls, cls.__dict__[name]) for cls in owners]
    for cls, orig in saved:
        def counted(self: object, *a: object, _orig: Any = orig, **k: object) -> Any:
            calls.append(name)
            return _orig(self, *a, **k)

        setattr(cls, name, counted)
    try:
        yield
    finally:
        for cls, orig in saved:
            setattr(cls, name, orig)


def exception_probe(backend: str, steps: int = 8) -> Result:
    """j: a completed one-rank broadcast; ppsync's completion of it, and
    ``steps`` steps of a one-rank token path, with every ``exception()``
    call counted; then ``work.exception()`` itself."""
    dev = device_of(0)
    with one_rank_group(backend) as (group, completion):
        work, _ = issued(group, dev, 0.0)
        completed = until_completed(work)
        calls: list[str] = []
        with counting_calls([dist.Work, type(work)], "exception", calls):
            ended, well = completion.ended(work), completion.ended_well(work)
            failure = getattr(completion, "failure", lambda w: None)(work)
            config = SyncConfig.build(pp_size=1, max_num_reqs=8, num_speculative_steps=2,
                                      timeout_s=TIMEOUT_S, codec="device",
                                      carrier=carrier_over(backend))
            path = TokenPath(config, group, device=dev)
            view = decode_view(4)
            tokens = torch.arange(12, device=dev, dtype=torch.int64).view(4, 3)
            ns = torch.full((4,), 3, dtype=torch.int32, device=dev)
            nr = torch.zeros(4, dtype=torch.int32, device=dev)
            for _ in range(steps):
                path.publish(view, SampledStep(tokens, ns, nr))
            path.close()
        said = _outcome(work.exception)
    return {"torch": torch.__version__, "completed": completed, "exception": said,
            "ended": ended, "ended_well": well, "failure": repr(failure),
            "ppsync_calls": len(calls), "steps": steps, "carrier": config.carrier}


def exception_verdict(res: Result) -> tuple[bool, str]:
    """j passes when ppsync never called ``exception()`` and its completion
    reads the completed work as ended well; what exception() did is reported."""
    ok = (res["ppsync_calls"] == 0 and res["completed"] and res["ended"] is True
          and res["ended_well"] is True and res["failure"] == "None")
    return ok, (f"torch {res['torch']}: work.exception() {res['exception']}; ppsync "
                f"({res['carrier']} carrier): "
                f"ended={res['ended']} ended_well={res['ended_well']} "
                f"failure={res['failure']}, exception() called {res['ppsync_calls']} times "
                f"by ppsync (completion + {res['steps']} path steps)")


# -- k) the abort of a pending broadcast ---------------------------------------------------


def abort_probe(backend: str, behind_s: float = 2.0, bound_s: float = 20.0) -> Result:
    """k: a broadcast pending behind ``behind_s`` of kernel, then ppsync's
    abort of the group with a cause; what the work and ppsync say after."""
    dev = device_of(0)
    with one_rank_group(backend) as (group, completion):
        work, _ = issued(group, dev, behind_s)
        pending = not work.is_completed()
        ended_before = completion.ended(work)
        cause = SyncTimeout("gpu-check: a planted deadline", peer=0)
        t0 = time.perf_counter()
        completion.abort(group, cause)
        call_s = time.perf_counter() - t0
        aborter = getattr(completion, "aborter", None)
        if aborter is not None:
            aborter.join(bound_s)
        abort_s = time.perf_counter() - t0 if aborter is None or not aborter.is_alive() else None
        res: Result = {
            "pending": pending, "ended_before": ended_before, "call_s": call_s,
            "abort_s": abort_s, "has_aborter": aborter is not None,
            "is_completed": _outcome(work.is_completed), "wait": _outcome(work.wait),
            "ended": completion.ended(work), "ended_well": completion.ended_well(work),
            "failure_is_cause": getattr(completion, "failure", lambda w: None)(work) is cause,
        }
        synced = _outcome(lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else "cpu"
        res.update(synced=synced, is_completed_after_sync=_outcome(work.is_completed))
    return res


def abort_verdict(res: Result, behind_s: float = 2.0) -> tuple[bool, str]:
    """k passes when the work was pending before the abort (the premise), the
    abort returned to its caller at once (< 1 s: NCCL's own abort runs on a
    thread of ppsync's), and ppsync counts the work as failed with the cause."""
    premise = res["pending"] and res["ended_before"] is False
    ppsync_ok = res["ended"] is True and res["ended_well"] is False and res["failure_is_cause"]
    ok = bool(premise and ppsync_ok and res["call_s"] < 1.0)
    nccl = ("did not end within its bound" if res["abort_s"] is None
            else f"ran {res['abort_s'] * 1e3:.0f} ms")
    return ok, (f"{'' if premise else 'premise FALSE (the work was not pending); '}"
                f"abort() held the caller {res['call_s'] * 1e3:.1f} ms, the group's abort "
                f"{nccl}; after it: is_completed() {res['is_completed']}, wait() "
                f"{res['wait']}; after a device sync ({res['synced']}): is_completed() "
                f"{res['is_completed_after_sync']}; ppsync: ended={res['ended']} "
                f"ended_well={res['ended_well']} failure is the cause: "
                f"{res['failure_is_cause']} (a {behind_s:.0f} s kernel ahead)")


# -- l) is_completed() per call --------------------------------------------------------------


def _per_call_us(fn: Callable[[], bool], n: int) -> tuple[float, set[bool]]:
    """Median µs per call over 5 batches of ``n // 5`` calls, and what they said."""
    said: set[bool] = set()
    batches = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n // 5):
            said.add(fn())
        batches.append((time.perf_counter_ns() - t0) / (n // 5) / 1e3)
    return statistics.median(batches), said


def poll_cost_probe(backend: str, n: int = 20_000) -> Result:
    """l: µs per ``is_completed()`` (and per ppsync ``ended()``) on a
    completed work, then on one pending behind a 1 s kernel."""
    dev = device_of(0)
    with one_rank_group(backend) as (group, completion):
        done, _ = issued(group, dev, 0.0)
        until_completed(done)
        done_us, done_said = _per_call_us(done.is_completed, n)
        ended_us, _ = _per_call_us(lambda: completion.ended(done), n)
        pending, _ = issued(group, dev, 1.0)
        pending_us, pending_said = _per_call_us(pending.is_completed, n)
        until_completed(pending)
    return {"done_us": done_us, "done_said": sorted(done_said), "ended_us": ended_us,
            "pending_us": pending_us, "pending_said": sorted(pending_said), "n": n}


def poll_cost_verdict(res: Result) -> tuple[bool, str]:
    """l passes when the completed work read True and the pending one False
    on every call (the premise: it stayed pending while timed)."""
    ok = res["done_said"] == [True] and res["pending_said"] == [False]
    return ok, (f"is_completed(): {res['done_us']:.2f} µs/call completed, "
                f"{res['pending_us']:.2f} pending; ppsync's ended(): {res['ended_us']:.2f}; "
                f"answers completed {res['done_said']}, pending {res['pending_said']} "
                f"({res['n']} calls each)")


# -- the checks, as gpu_check's table runs them ---------------------------------------------


def check_j() -> tuple[bool, str]:
    return exception_verdict(exception_probe("nccl"))


def check_k() -> tuple[bool, str]:
    return abort_verdict(abort_probe("nccl"))


def check_l() -> tuple[bool, str]:
    return poll_cost_verdict(poll_cost_probe("nccl"))
