"""One contract, every codec: the same randomized workloads through each codec
variant, on real gloo ranks, must give what the reference (the host codec)
gives.

What "the same" means, field by field:

- every released step: the same ``ReleasedStep`` fields, values, dtypes and
  None-ness (``draft_tokens`` None exactly when the frame had no drafts),
  the same draft table after every consume, the same steps returning None;
  a consume that raises leaves the table as it was, on every codec (here
  the bad frames carry no drafts; tests/faults/test_codec_draft_table.py
  raises on frames with drafts);
- every bad input (the fuzz tests' bad sampler outputs, bad batch views and
  bad drafts): the same error type, naming the same thing, at the same call;
  except, as docs/design.md section 7 documents, a device codec's bad
  *values* (num_sampled / num_rejected out of range): they are checked on
  the device, so the last rank raises the same BatchError (the same
  field, row, value and rule) at its next call instead of at the publish,
  and every receiver raises it at the consume of that frame, where the host
  codec's receivers release the engine's corrected resend of that step.

A later codec (a kernel set, another device codec) is one more entry of
:data:`VARIANTS`: it must pass this test unchanged.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fault_fuzz_calls import OUTPUT_BAD, VIEW_BAD
from fault_fuzz_inputs import Bad, collect, replace_field
from twin_mode import Mode, check_engine_stream, mode_group

from ppsync.compat.vllm import PPHandler
from ppsync.core import SampledStep
from ppsync.core.codec.device import DeviceCodec
from ppsync.core.codec.device_kernels import triton_error
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

VARIANTS: list[dict[str, str]] = [
    {"codec": "host", "cpu_kernels": "numpy"},  # the reference
    {"codec": "host", "cpu_kernels": "numba"},
    {"codec": "device", "device_kernels": "torch"},
    {"codec": "device", "device_kernels": "triton"},  # in Triton's interpreter
    # the device codec on the CPU twin of NCCL (tests/twin_mode.py)
    {"codec": "device", "device_kernels": "torch", "emulate": "nccl"},
    {"codec": "device", "device_kernels": "triton", "emulate": "nccl"},
    # ... its frames through pinned host memory over gloo (the host carrier)
    {"codec": "device", "device_kernels": "torch", "emulate": "nccl", "carrier": "host"},
]
"""SyncConfig fields of each codec variant (and "emulate": the token group
behaves as NCCL's); the first is the reference."""


def _split(variant: dict[str, str]) -> tuple[dict[str, str], Mode]:
    """(the SyncConfig fields, the completion mode) of a variant."""
    fields = {k: v for k, v in variant.items() if k != "emulate"}
    if "emulate" not in variant:
        return fields, "gloo"
    if variant.get("carrier") == "host":
        return fields, "carried"
    return fields | {"carrier": "device"}, "twin"


def _variants(*, twin: bool = True) -> list[object]:
    """The variants after the reference, as test parameters: one whose
    library cannot be loaded here is skipped, saying why."""
    out: list[object] = []
    for v in VARIANTS[1:]:
        if "emulate" in v and not twin:
            continue
        why = triton_error() if v.get("device_kernels") == "triton" else None
        marks = [pytest.mark.skip(reason=f"Triton cannot be loaded ({why}); "
                                  "install ppsync[triton]")] if why else []
        out.append(pytest.param(v, id=",".join(v.values()), marks=marks))
    return out

MAX_NUM_REQS, STEPS, TIMEOUT_S = 8, 90, 20.0
BAD_EVERY = 4  # steps t % BAD_EVERY == 3 carry one bad call (k = 2)
WIDTH_1 = "num_rejected 1 in a width-1 step"
VALUE_RE = re.compile(r"(num_\w+\[\d+\] = -?\d+ outside \[[^\]]*\])")

Record = tuple[object, ...]


@dataclass
class Seen:
    released: dict[int, Record] = field(default_factory=dict)  # receivers, step -> record
    errors: list[tuple[int, str, str]] = field(default_factory=list)  # (step, type, message)
    table_kept: list[bool] = field(default_factory=list)  # per raising consume: table as it was


def _record(out: object, table: torch.Tensor | None) -> Record:
    if out is None:
        return (None, None if table is None else table.clone().numpy().tolist())
    fields = []
    for name in ("sampled_tokens", "num_sampled", "num_rejected", "idx_mapping", "draft_tokens"):
        t = getattr(out, name)
        fields.append(None if t is None else (str(t.dtype), t.numpy().tolist()))
    fields.append(out.seq)  # type: ignore[attr-defined]
    fields.append(out.kept_np.tolist())  # type: ignore[attr-defined]
    return (tuple(fields), None if table is None else table.clone().numpy().tolist())


@dataclass
class Step:
    view: BatchView | None  # None: an empty schedule
    width: int | None
    tokens: torch.Tensor  # [n, w or L] int64
    num_sampled: torch.Tensor  # [n] int32
    num_rejected: torch.Tensor  # [n] int32
    drafts: torch.Tensor | None  # [n, K] int64
    frees: list[int]


def _schedule(k: int, seed: int) -> list[Step]:
    """The same steps on every rank: frees in flight, empty steps, rows in
    prefill (excluded), widths 1..L, steps with and without drafts."""
    rng = np.random.default_rng(seed)
    L, steps = k + 1, []
    for t in range(STEPS):
        frees = sorted(rng.choice(MAX_NUM_REQS, rng.integers(0, 3), replace=False).tolist())
        if rng.random() < 0.15 and t % BAD_EVERY != 3:
            steps.append(Step(None, None, torch.empty(0), torch.empty(0), torch.empty(0),
                              None, frees))
            continue
        n = int(rng.integers(1, 7))
        idx = rng.permutation(MAX_NUM_REQS)[:n].astype(np.int64)
        prefill = rng.random(n) < 0.2
        computed = rng.integers(0, 50, n).astype(np.int64)
        view = BatchView(
            num_reqs=n, idx_mapping_np=idx, num_computed_tokens_np=computed,
            num_scheduled_tokens_np=np.ones(n, dtype=np.int64),
            prefill_len_np=np.where(prefill, computed + 5, computed).astype(np.int64))
        width = None if k == 0 or rng.random() < 0.3 else int(rng.integers(1, L + 1))
        w = L if width is None else width
        tokens = torch.from_numpy(rng.integers(0, 1 << 40, (n, w)).astype(np.int64))
        ns = torch.from_numpy(rng.integers(0, w + 1, n).astype(np.int32))
        nr = torch.from_numpy(rng.integers(0, min(k, w - 1) + 1, n).astype(np.int32))
        drafts = (torch.from_numpy(rng.integers(0, 1 << 40, (n, k)).astype(np.int64))
                  if k and rng.random() < 0.6 else None)
        steps.append(Step(view, width, tokens, ns, nr, drafts, frees))
    return steps


def _bad_calls() -> list[Bad]:
    """The fuzz tests' bad sampler outputs (type, dtype, shape, range) and bad
    batch-view fields, a few of each, in a fixed order."""
    # a width-1 step (vLLM 0.33: no drafts) rejects nothing
    bads: list[Bad] = [Bad("num_rejected", "range", WIDTH_1, torch.tensor([0, 1, 0]))]
    for name in ("num_sampled", "num_rejected", "sampled_token_ids"):
        bads += collect(OUTPUT_BAD[name], 4)
    for name in ("num_reqs", "idx_mapping_np", "prefill_len_np"):
        bads += [replace_bad(b, name) for b in collect(VIEW_BAD[name], 2)]
    return bads


def replace_bad(bad: Bad, attr: str) -> Bad:
    return Bad(bad.field, bad.kind, f"view.{attr}: {bad.label}", (attr, bad.value))


def _bad_publish(step: Step, bad: Bad) -> dict[str, object]:
    """The publish of ``step`` (3 decode rows at full width, as the fuzz
    tests' base call) with one input broken."""
    args: dict[str, object] = {"view": step.view, "sampled_token_ids": step.tokens,
                               "num_sampled": step.num_sampled,
                               "num_rejected": step.num_rejected}
    if isinstance(bad.value, tuple) and len(bad.value) == 2 and isinstance(bad.value[0], str):
        attr, value = bad.value
        args["view"] = replace_field(step.view, attr, value)
    else:
        args[bad.field] = bad.value
    return args


def _fuzz_base(step: Step, bad: Bad) -> Step:
    from fault_fuzz_calls import BASE_IDX, BASE_R, outputs
    n = len(BASE_IDX)
    view = BatchView(num_reqs=n, idx_mapping_np=np.array(BASE_IDX, dtype=np.int64),
                     num_computed_tokens_np=np.full(n, 10, dtype=np.int64),
                     num_scheduled_tokens_np=np.ones(n, dtype=np.int64),
                     prefill_len_np=np.full(n, 5, dtype=np.int64))
    o = outputs(BASE_R)
    tokens, ns = o["sampled_token_ids"], o["num_sampled"]
    assert isinstance(tokens, torch.Tensor) and isinstance(ns, torch.Tensor)
    if bad.label == WIDTH_1:
        return Step(view, 1, tokens[:, :1].clone(), torch.clamp(ns, max=1),
                    torch.zeros(n, dtype=torch.int32), None, step.frees)
    return Step(view, None, tokens, ns, o["num_rejected"],  # type: ignore[arg-type]
                None, step.frees)


def _uses(path: TokenPath, variant: dict[str, str]) -> None:
    """The path runs the kernels the variant names (none silently swapped)."""
    codec = path.codec
    if "cpu_kernels" in variant:
        assert codec.kernels.name == variant["cpu_kernels"]
    if "device_kernels" in variant:
        assert codec.device_kernels_name == variant["device_kernels"]
    if "carrier" in variant:
        assert isinstance(codec, DeviceCodec) and codec.carrier.name == variant["carrier"]


def variant_path(variant: dict[str, str], k: int) -> tuple[TokenPath, Mode]:
    """A token path over the world running ``variant`` (its kernels checked)."""
    fields, mode = _split(variant)
    config = SyncConfig.build(pp_size=2, max_num_reqs=MAX_NUM_REQS, num_speculative_steps=k,
                              timeout_s=TIMEOUT_S, **fields)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    path = TokenPath(config, mode_group(group, mode), board=None)
    _uses(path, fields)
    assert path.completion.stream_ordered == (mode == "twin")
    return path, mode


def _rank(variant: dict[str, str], k: int, seed: int, env: RankEnv) -> Seen:
    path, mode = variant_path(variant, k)
    table = torch.full((MAX_NUM_REQS, k), -7, dtype=torch.int64) if k else None
    steps, bads, seen = _schedule(k, seed), _bad_calls(), Seen()
    for t in range(STEPS + 2):
        step = steps[t] if t < STEPS else None
        if not path.is_last:
            before = None if table is None else table.clone()
            try:
                seen.released[t] = _record(path.consume(table), table)
            except PPSyncError as e:
                seen.errors.append((t, type(e).__name__, str(e)))
                kept = table is None or before is None or bool(torch.equal(table, before))
                seen.table_kept.append(kept)
        if step is None:
            continue
        for slot in step.frees:
            path.free(slot)
        bad = bads[(t // BAD_EVERY) % len(bads)]
        if t % BAD_EVERY == 3 and k == 2:
            step = _fuzz_base(step, bad)
        if step.view is None:
            continue
        if not path.is_last:
            path.post(step.view, sample_width=step.width,
                      expect_drafts=None if k == 0 else step.drafts is not None)
            continue
        valid: dict[str, object] = {
            "view": step.view, "sampled_token_ids": step.tokens,
            "num_sampled": step.num_sampled, "num_rejected": step.num_rejected}
        first = valid
        if t % BAD_EVERY == 3 and k == 2:
            first = _bad_publish(step, bad)
        for args in (first, valid):
            try:
                a: dict[str, Any] = args  # a bad value among them, as given
                sampled = SampledStep[torch.Tensor](a["sampled_token_ids"], a["num_sampled"],
                                                    a["num_rejected"], step.drafts, step.width)
                prepared, drafts = path.prepare(args["view"], sampled)  # type: ignore[arg-type]
                path.send(prepared, drafts)
                break
            except PPSyncError as e:
                seen.errors.append((t, type(e).__name__, str(e)))
    try:
        path.close()
    except PPSyncError as e:
        seen.errors.append((STEPS + 2, type(e).__name__, str(e)))
    check_engine_stream(mode)
    return seen


def _value(message: str) -> str | None:
    m = VALUE_RE.search(message)
    return None if m is None else m.group(1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("variant", _variants())
def test_every_codec_releases_what_the_reference_releases(k: int,
                                                          variant: dict[str, str]) -> None:
    seed = 11 + k
    ref_recv, ref_last = spawn_ranks(functools.partial(_rank, VARIANTS[0], k, seed), 2,
                                     timeout_s=120)
    got_recv, got_last = spawn_ranks(functools.partial(_rank, variant, k, seed), 2,
                                     timeout_s=120)
    if k:  # every bad call was made, and the width rule holds on every codec
        assert len(ref_last.errors) >= len(_bad_calls()), ref_last.errors
        for errors in (ref_last.errors, got_last.errors):
            assert any("sample width 1 verifies at most 0 drafts" in m for _, _, m in errors)
    # the last rank: the same errors, each at the same call, except that a
    # bad value may raise at the next publishing call (deferred, documented)
    assert len(got_last.errors) == len(ref_last.errors), (ref_last.errors, got_last.errors)
    deferred: dict[int, str] = {}  # step whose bad value the receivers may raise on
    for (rt, rtype, rmsg), (gt, gtype, gmsg) in zip(ref_last.errors, got_last.errors,
                                                    strict=True):
        assert gtype == rtype, (rmsg, gmsg)
        value = _value(rmsg)
        if value is not None and gt != rt:
            assert gt > rt and _value(gmsg) == value, (rmsg, gmsg)
            assert "step seq" in gmsg and "was sent" in gmsg, gmsg
            deferred[rt] = value
        else:
            assert gt == rt, (rmsg, gmsg)
            assert gmsg == rmsg or (value is not None and _value(gmsg) == value), (rmsg, gmsg)
    # receivers: every consume alike, but where the last rank's bad value was
    # sent: the receiver raises on it (naming the same value) at that consume
    # instead of releasing the corrected resend
    assert all(got_recv.table_kept), got_recv.errors  # a raising consume leaves the table
    ref_err = {t: (ty, m) for t, ty, m in ref_recv.errors}
    got_err = {t: (ty, m) for t, ty, m in got_recv.errors}
    assert not ref_err, ref_err
    consumed_at = {t + 2: bad for t, bad in deferred.items()}  # D = P = 2 steps later
    for t in sorted(set(ref_recv.released) | set(got_err)):
        if t in consumed_at:
            assert t in got_err and _value(got_err[t][1]) == consumed_at[t], got_err.get(t)
            continue
        assert t not in got_err, got_err[t]
        assert got_recv.released[t] == ref_recv.released[t], f"step {t}"
    assert len(ref_recv.released) >= STEPS


# -- the vLLM adapter, each draft interface ----------------------------------------------------

def _adapter_rank(variant: dict[str, str], interface: str, seed: int,
                  env: RankEnv) -> list[Record]:
    k = 2
    table_shape = interface in ("0.30", "0.32")  # the draft table in and out (0.33: gathered)
    steps, out = _schedule(k, seed), list[Record]()
    table = torch.full((MAX_NUM_REQS, k), -7, dtype=torch.int64)
    # the twin through the adapter's own argument: its token group takes the
    # same completion choice as every path's (emulate, then completion_for)
    fields, mode = _split(variant)
    if "emulate" in variant:
        fields["emulate"] = variant["emulate"]
    with PPHandler(MAX_NUM_REQS, k, torch.device("cpu"), timeout_s=TIMEOUT_S,
                   interface=interface, board=None, **fields) as h:  # type: ignore[arg-type]
        _uses(h._path, fields)
        assert h._path.completion.stream_ordered == (mode == "twin")
        if mode == "twin":
            assert h._path.completion.name == f"stream-ordered (twin of {variant['emulate']})"
        for t in range(STEPS + 2):
            step = steps[t] if t < STEPS else None
            got = (h.get_prev_sampled_outputs(table) if table_shape
                   else h.get_prev_sampled_outputs())
            if got is not None:
                values: dict[str, torch.Tensor | None] = dict(got)  # type: ignore[arg-type]
                out.append((t, tuple(
                    (key, None if v is None else (str(v.dtype), v.tolist()))
                    for key, v in sorted(values.items())), table.tolist()))
            if step is None:
                continue
            for slot in step.frees:
                h.on_req_idx_freed(slot)
            if step.view is None:
                continue
            batch = _Batch(step.view, 0 if step.width == 1 else k)
            has = step.drafts is not None and step.width != 1
            if not h.is_last_rank:
                if table_shape:
                    h.receive(batch)
                else:
                    h.receive(batch, has)
                continue
            w = k + 1 if table_shape or step.width != 1 else 1
            tokens = torch.full((step.view.num_reqs, w), -1, dtype=torch.int64)
            ns = torch.clamp(step.num_sampled, max=w)
            nr = torch.clamp(step.num_rejected, max=w - 1)
            h.broadcast(tokens, ns, nr, batch)
            if has:
                drafts = step.drafts
                assert drafts is not None
                if table_shape:
                    full = torch.zeros((MAX_NUM_REQS, k), dtype=torch.int64)
                    full[torch.from_numpy(step.view.idx_mapping_np)] = drafts
                    h.broadcast_drafts(full, batch)
                else:
                    h.broadcast_drafts(drafts)
    check_engine_stream(_split(variant)[1])  # twin: no engine-stream wait on an unconsumed one
    return out


@dataclass
class _Batch:
    """An input batch as vLLM's adapter reads it."""

    view: BatchView
    num_draft_tokens: int

    def __getattr__(self, name: str) -> object:
        names = {"num_scheduled_tokens": "num_scheduled_tokens_np"}
        return getattr(self.view, names.get(name, name))


ADAPTER_VARIANTS = [*_variants(), pytest.param(
    {"codec": "device", "device_kernels": "torch", "emulate": "xccl"}, id="device,torch,xccl")]
"""Every codec variant, on the twin of NCCL and of XCCL too (as the vLLM
plugin's PPSYNC_EMULATE builds it)."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("interface", ["0.30", "0.32", "0.33"])
@pytest.mark.parametrize("variant", ADAPTER_VARIANTS)
def test_the_vllm_adapter_gives_the_same_outputs_with_every_codec(
        interface: str, variant: dict[str, str]) -> None:
    ref = spawn_ranks(functools.partial(_adapter_rank, VARIANTS[0], interface, 5), 2,
                      timeout_s=120)
    got = spawn_ranks(functools.partial(_adapter_rank, variant, interface, 5), 2,
                      timeout_s=120)
    assert len(ref[0]) > STEPS // 2
    assert got[0] == ref[0]
