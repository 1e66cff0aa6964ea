"""The device codec's kernel sets (torch ops; Triton, in its interpreter)
against the host codec (numpy): the same step gives the same frame, word for
word, and the same release; their checks give the same verdicts without
reading values on the host; platforms are chosen from the device."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppsync.core import SampledStep
from ppsync.core.codec.device_kernels import (
    DeviceKernels,
    Outputs,
    device_kernels_for,
    triton_error,
)
from ppsync.core.frame import (
    FLAG_BAD_VALUES,
    HEADER_WORDS,
    BufferPool,
    FrameView,
    slot_need_words,
)
from ppsync.core.frame.device_frames import (
    V_DRAFTS,
    V_FLAGGED,
    V_FRAME,
    V_NUM_REJECTED,
    V_NUM_SAMPLED,
    DeviceFrames,
)
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.rules.checks import check_sampled_meta, value_bounds
from ppsync.core.wire.platform import CudaPlatform, Platform, XpuPlatform, platform_for
from ppsync.errors import BatchError, ConfigError
from ppsync.schemas.config import SyncConfig

CPU = torch.device("cpu")


def _step(k: int, n: int, w: int, seed: int) -> tuple[FrameView, np.ndarray, np.ndarray,
                                                      np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    idx = rng.permutation(16)[:n].astype(np.int64)
    need = rng.random(n) < 0.8
    computed = rng.integers(0, 1 << 40, n).astype(np.int64)
    # token ids near 2**62: the weighted sums wrap int64 many times over
    tokens = rng.integers(1 << 61, 1 << 62, (n, w)).astype(np.int64)
    ns = rng.integers(0, w + 1, n).astype(np.int32)
    nr = rng.integers(0, min(k, w - 1) + 1, n).astype(np.int32)  # a width-w step rejects < w
    codec = NumpyFrames(SyncConfig.build(pp_size=2, max_num_reqs=16, num_speculative_steps=k))
    facts = np.stack([slot_need_words(idx, need), computed.astype(np.int64)])
    view = FrameView(7, n, codec.facts_digest(facts), slot_need_words(idx, need),
                     computed, None if w == k + 1 else w)
    return view, tokens, ns, nr, rng.integers(0, 1 << 62, (n, k)).astype(np.int64)


KERNEL_SETS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        triton_error() is not None,
        reason=f"Triton cannot be loaded ({triton_error()}): install ppsync[triton]")),
]
"""The device kernel sets; Triton's run in its interpreter on CPU tensors."""


def kernel_set(name: str, dev: DeviceFrames) -> DeviceKernels:
    config = SyncConfig.build(pp_size=2, max_num_reqs=dev.layout.max_num_reqs,
                              num_speculative_steps=dev.layout.num_drafts,
                              device_kernels=name)
    ks = device_kernels_for(config, dev)
    assert ks.name == name
    return ks


def dev_staging(dev: DeviceFrames) -> torch.Tensor:
    return Platform(CPU).host_buffer(dev.layout.staging.words)


def pack(ks: DeviceKernels, dev: DeviceFrames, view: FrameView, flags: int,
         tokens: np.ndarray, ns: np.ndarray, nr: np.ndarray, drafts: np.ndarray | None,
         ) -> tuple[torch.Tensor, int]:
    """(the frame, the verdict) of one step packed by ``ks``."""
    lay, n, w = dev.layout, view.num_reqs, tokens.shape[1]
    staging = dev_staging(dev)
    dev.stage(staging.numpy(), view, flags, value_bounds(w, lay.num_drafts, view.width(lay)))
    buf = dev.buffers.take(n)
    buf[:] = 7  # stale words from an earlier frame must not matter
    verdict = torch.zeros(1, dtype=torch.int64)
    ks.pack(buf, staging, n, SampledStep(
        torch.from_numpy(tokens), torch.from_numpy(ns), torch.from_numpy(nr),
        None if drafts is None else torch.from_numpy(drafts)), verdict)
    return buf, int(verdict[0])


def release(ks: DeviceKernels, dev: DeviceFrames, buf: torch.Tensor, view: FrameView,
            keep: np.ndarray | None = None, expect: bool | None = None,
            table: torch.Tensor | None = None) -> tuple[int, Outputs]:
    """(the verdict, the outputs) of one received frame checked and released
    by ``ks`` against ``view`` (idx: the view's slot_need // 2)."""
    lay, n = dev.layout, view.num_reqs
    w = view.width(lay)
    staging = dev_staging(dev)
    dev.stage(staging.numpy(), view, 0, value_bounds(w, lay.num_drafts, w))
    assert view.slot_need_np is not None
    idx = view.slot_need_np // 2
    keep = np.ones(n, dtype=bool) if keep is None else keep
    s, at = staging.numpy(), lay.staging
    rows = np.flatnonzero(keep)
    s[at.idx_out : at.idx_out + n] = np.where(keep, idx, -1)
    s[at.kept_slots : at.kept_slots + rows.shape[0]] = idx[rows]
    s[at.kept_rows : at.kept_rows + rows.shape[0]] = rows
    K = lay.num_drafts
    out = Outputs(torch.full((n, w), -9, dtype=torch.int64),
                  torch.full((2, n), -9, dtype=torch.int32), torch.full((n,), -9),
                  torch.full((n, K), -9) if K else None)
    verdict = torch.zeros(1, dtype=torch.int64)
    ks.release(buf, staging, n, expect, out, table, int(rows.shape[0]), verdict)
    return int(verdict[0]), out


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("wire", ["fixed", "exact"])
@pytest.mark.parametrize("with_drafts", [True, False])
@pytest.mark.parametrize("narrow", [False, True])
def test_device_frame_equals_host_frame(kernels: str, k: int, wire: str, with_drafts: bool,
                                        narrow: bool) -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=16, num_speculative_steps=k, wire=wire)
    host, dev = NumpyFrames(config), DeviceFrames(config, CPU)
    ks = kernel_set(kernels, dev)
    w = 1 if narrow else k + 1
    view, tokens, ns, nr, drafts = _step(k, 11, w, seed=k * 10 + w)
    has = with_drafts and k > 0
    hbuf = BufferPool(host).take(11)
    hbuf.numpy()[:] = 0
    host.pack(hbuf.numpy(), view, tokens, ns, nr, drafts if has else None)
    dbuf, verdict = pack(ks, dev, view, dev.layout.flags(has), tokens, ns, nr,
                         drafts if has else None)
    assert verdict == 0
    used = host.used(11)
    assert np.array_equal(dbuf.numpy()[:used], hbuf.numpy()[:used])
    host.check(dbuf.numpy(), view, rank=0)  # the host codec accepts the device's frame
    # the device check of that frame against the same view passes, and the
    # release hands out the host codec's rows
    keep = np.arange(11) % 3 != 1
    table = torch.full((16, k), -5, dtype=torch.int64)
    verdict, out = release(ks, dev, dbuf, view, keep, expect=has, table=table if k else None)
    assert verdict == 0
    rows = host.rows(hbuf.numpy(), 11)
    assert np.array_equal(out.tokens.numpy(), rows[:, :w])
    assert out.counts.dtype == torch.int32
    assert np.array_equal(out.counts.numpy(), np.stack([ns, nr]))
    assert view.slot_need_np is not None
    assert np.array_equal(out.idx_mapping.numpy(), np.where(keep, view.slot_need_np // 2, -1))
    if k:
        assert out.drafts is not None
        assert np.array_equal(out.drafts.numpy(), host.drafts(rows))
        want = np.full((16, k), -5)
        if has:
            want[view.slot_need_np[keep] // 2] = drafts[keep]
        assert np.array_equal(table.numpy(), want)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize(("field", "value", "bit"), [
    ("num_sampled", 4, V_NUM_SAMPLED), ("num_sampled", -1, V_NUM_SAMPLED),
    ("num_rejected", 3, V_NUM_REJECTED), ("num_rejected", -2, V_NUM_REJECTED),
])
def test_bad_values_give_a_verdict_and_flag_the_frame(kernels: str, field: str, value: int,
                                                      bit: int) -> None:
    k = 2
    config = SyncConfig.build(pp_size=2, max_num_reqs=16, num_speculative_steps=k)
    dev = DeviceFrames(config, CPU)
    ks = kernel_set(kernels, dev)
    view, tokens, ns, nr, _ = _step(k, 5, k + 1, seed=3)
    (ns if field == "num_sampled" else nr)[2] = value
    buf, verdict = pack(ks, dev, view, dev.layout.flags(False), tokens, ns, nr, None)
    assert verdict == bit
    assert int(buf[5]) & FLAG_BAD_VALUES
    # a receiver's check sees the flag and the value itself
    assert release(ks, dev, buf, view)[0] == bit | V_FLAGGED
    err = dev.value_error(buf.numpy(), 5, k + 1, k + 1, "")
    rule = "w = 3" if field == "num_sampled" else "K = 2"
    assert re.search(rf"{field}\[2\] = {value} outside \[0, {rule}\]", str(err))


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_a_receivers_other_view_is_a_frame_verdict(kernels: str) -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=16, num_speculative_steps=1)
    dev = DeviceFrames(config, CPU)
    ks = kernel_set(kernels, dev)
    view, tokens, ns, nr, _ = _step(1, 4, 2, seed=5)
    buf, _ = pack(ks, dev, view, 0, tokens, ns, nr, None)
    assert view.computed_np is not None and view.slot_need_np is not None
    other = FrameView(view.seq, 4, view.idx_digest, view.slot_need_np, view.computed_np + 1)
    assert release(ks, dev, buf, other)[0] == V_FRAME
    assert release(ks, dev, buf, view, expect=True)[0] == V_DRAFTS
    later = FrameView(view.seq + 1, 4, view.idx_digest, view.slot_need_np, view.computed_np)
    assert release(ks, dev, buf, later)[0] == V_FRAME
    buf[7] += 1  # the checksum word disagrees with the payload
    assert release(ks, dev, buf, view)[0] == V_FRAME


def assert_released_nothing(out: Outputs, table: torch.Tensor | None,
                            before: torch.Tensor | None) -> None:
    """A failed frame's release: every row excluded, num_sampled and
    num_rejected 0, tokens and drafts -1, the draft table byte-identical."""
    assert out.counts.dtype == torch.int32
    assert (out.counts == 0).all(), out.counts
    assert (out.tokens == -1).all(), out.tokens
    assert (out.idx_mapping == -1).all(), out.idx_mapping
    assert out.drafts is None or (out.drafts == -1).all(), out.drafts
    if table is not None:
        assert before is not None
        assert table.dtype == before.dtype
        assert table.numpy().tobytes() == before.numpy().tobytes()


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("failure", "bit"), [
    ("header", V_FRAME), ("checksum", V_FRAME), ("payload", V_FRAME), ("view", V_FRAME),
    ("num_sampled", V_NUM_SAMPLED | V_FLAGGED), ("num_rejected", V_NUM_REJECTED | V_FLAGGED),
    ("drafts", V_DRAFTS),
])
def test_a_failed_check_releases_no_token(kernels: str, dtype: torch.dtype, failure: str,
                                          bit: int) -> None:
    """Issue 26 item 4 / issue 27 finding 2: a frame with drafts whose check
    fails hands out no token and leaves the caller's draft table as it was
    (the host codec raises before releasing; the device verdict is read a
    call later)."""
    k, n = 2, 6
    config = SyncConfig.build(pp_size=2, max_num_reqs=16, num_speculative_steps=k)
    dev = DeviceFrames(config, CPU)
    ks = kernel_set(kernels, dev)
    view, tokens, ns, nr, drafts = _step(k, n, k + 1, seed=9)
    if failure in ("num_sampled", "num_rejected"):
        (ns if failure == "num_sampled" else nr)[4] = -1
    buf, _ = pack(ks, dev, view, dev.layout.flags(True), tokens, ns, nr, drafts)
    mine, expect = view, True
    if failure == "header":
        buf[2] ^= 1 << 3
    elif failure == "checksum":
        buf[HEADER_WORDS - 1] += 1
    elif failure == "payload":
        buf[HEADER_WORDS + 3 * dev.layout.row_width + 1] ^= 1 << 20
    elif failure == "view":
        assert view.computed_np is not None and view.slot_need_np is not None
        mine = FrameView(view.seq, n, view.idx_digest, view.slot_need_np, view.computed_np + 1)
    elif failure == "drafts":
        expect = False
    table = torch.arange(16 * k, dtype=dtype).reshape(16, k) - 100
    before = table.clone()
    keep = np.arange(n) % 2 == 0
    verdict, out = release(ks, dev, buf, mine, keep, expect, table)
    assert verdict == bit
    assert_released_nothing(out, table, before)
    # the same frame intact, against the same view: released, table written
    if failure in ("header", "checksum", "payload", "view"):
        good, _ = pack(ks, dev, view, dev.layout.flags(True), tokens, ns, nr, drafts)
        verdict, out = release(ks, dev, good, view, keep, True, table)
        assert verdict == 0 and (out.idx_mapping >= 0).any()
        assert not np.array_equal(table.numpy(), before.numpy())


def test_meta_checks_do_not_read_values_but_name_the_field() -> None:
    t = torch.zeros(3, 2, dtype=torch.int64)
    ns = torch.full((3,), 99, dtype=torch.int32)  # out of range: not looked at here
    check_sampled_meta(t, ns, ns, num_reqs=3, sample_width=2, device=CPU)
    with pytest.raises(BatchError, match=r"num_sampled.dtype = torch.float32 must be"):
        check_sampled_meta(t, ns.float(), ns, num_reqs=3, sample_width=2, device=CPU)
    with pytest.raises(BatchError, match=r"sampled_token_ids is on cpu; the token path's "
                       r"device is meta"):
        check_sampled_meta(t, ns, ns, num_reqs=3, sample_width=2, device=torch.device("meta"))
    with pytest.raises(BatchError, match=r"sampled_token_ids.shape\[1\] = 2 must lie in"):
        check_sampled_meta(t, ns, ns, num_reqs=3, sample_width=1, device=CPU)


def test_platform_is_chosen_from_the_device_and_can_be_overridden() -> None:
    assert type(platform_for(None)) is Platform
    assert platform_for("cpu").backend == "gloo"
    assert CudaPlatform(torch.device("cuda", 0)).backend == "nccl"
    assert XpuPlatform(torch.device("xpu", 0)).backend == "xccl"
    assert XpuPlatform.ring_depth_hint == 1
    with pytest.raises(ConfigError, match=r"platform = 'tpu' .* must be one of cpu, cuda, xpu"):
        platform_for("cpu", "tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_device_gets_the_cuda_platform() -> None:
    cuda = platform_for("cuda")
    assert isinstance(cuda, CudaPlatform) and cuda.device.index is not None
    assert type(platform_for("cuda", "cpu")) is Platform
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"device cuda:{n}: index out of range; {n} cuda"):
        platform_for(f"cuda:{n}")


@pytest.mark.parametrize(("device", "name", "kind"),
                         [("cuda", None, "cuda"), ("cuda:1", None, "cuda"), ("xpu", None, "xpu"),
                          ("cuda", "cpu", "cuda"), ("cpu", "cuda", "cuda"), ("cpu", "xpu", "xpu")])
def test_a_device_this_torch_cannot_run_is_refused_by_name(
        device: str, name: str | None, kind: str) -> None:
    if getattr(torch, kind).is_available():
        pytest.skip(f"this machine has a {kind} device")
    built = (torch.version.cuda is not None if kind == "cuda" else torch.xpu._is_compiled())
    why = "was built without" if not built else r"is_available\(\) is False"
    with pytest.raises(ConfigError, match=rf"device {kind}: .*{why}"):
        platform_for(device, name)


def test_cpu_platform_stream_calls_are_no_ops() -> None:
    p = platform_for("cpu")
    s = p.new_stream()
    assert s is None and p.current_stream() is None and not p.has_streams
    with p.use(s):
        p.wait_stream(s, s)
        ev = p.record_event(s)
    assert ev.query()
    t = torch.zeros(2)
    p.record_stream(t, s)
    p.before_send(s)
    with p.capture_safe():
        pass


def test_xpu_orders_its_send_with_an_event_never_a_host_sync() -> None:
    """Rule 6 on XPU: the side stream that issues the collective waits on
    an event recorded on the main stream; the main stream is never
    synchronized from the host (the overlap async scheduling relies on)."""
    calls: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def synchronize(self) -> None:
            calls.append(f"{self.name}.synchronize")

        def wait_event(self, event: object) -> None:
            calls.append(f"{self.name}.wait_event({event})")

    side, main = Stream("side"), Stream("main")

    class RecordedEvent:
        def record(self, stream: Stream) -> None:
            calls.append(f"record on {stream.name}")

        def __str__(self) -> str:
            return "event"

    class Xpu:  # torch.xpu's calls that before_send makes, recorded
        Event = RecordedEvent

        @staticmethod
        def current_stream(device: object) -> Stream:
            return side

    class Recorded(XpuPlatform):
        @property
        def _mod(self) -> object:
            return Xpu

    Recorded(torch.device("cpu")).before_send(main)
    assert calls == ["record on main", "side.wait_event(event)"]



@st.composite
def _cases(draw: st.DrawFn) -> dict[str, object]:
    k = draw(st.integers(0, 3))
    n = draw(st.integers(1, 12))
    w = draw(st.integers(1, k + 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return {
        "k": k, "n": n, "w": w, "rng": rng,
        "wire": draw(st.sampled_from(["fixed", "exact"])),
        "drafts": k > 0 and draw(st.booleans()),
        # sometimes out of range: the verdict bits and the flag
        "ns": rng.integers(-1 if draw(st.booleans()) else 0, w + 2, n).astype(np.int32),
        "nr": rng.integers(-1 if draw(st.booleans()) else 0, k + 2, n).astype(np.int64),
        "keep": rng.random(n) < 0.7,
        "table": draw(st.sampled_from([None, torch.int32, torch.int64])),
        "expect": draw(st.sampled_from([None, True, False])),
        # a received frame's word changed in flight (None: intact), or the
        # receiver's own view of one row differs (the checksum still holds)
        "corrupt": draw(st.sampled_from([None, "header", "facts", "payload", "checksum",
                                         "view"])),
    }


@pytest.mark.skipif(triton_error() is not None,
                    reason=f"Triton cannot be loaded ({triton_error()}): install ppsync[triton]")
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_both_kernel_sets_agree_on_every_frame_release_and_verdict(
        case: dict[str, Any]) -> None:
    """One contract: the same step packed by each set gives the same words
    and verdict (the host codec's frame when the values are valid); the same
    received frame, intact or changed in flight, gives each set the same
    verdict, outputs and draft table."""
    k, n, w, rng = case["k"], case["n"], case["w"], case["rng"]
    config = SyncConfig.build(pp_size=2, max_num_reqs=16, num_speculative_steps=k,
                              wire=case["wire"])
    host, dev = NumpyFrames(config), DeviceFrames(config, CPU)
    sets = [kernel_set(name, dev) for name in ("torch", "triton")]
    view, tokens, _, _, drafts = _step(k, n, w, seed=int(rng.integers(1 << 30)))
    ns, nr = case["ns"], case["nr"]
    dr = drafts if case["drafts"] else None
    flags = dev.layout.flags(dr is not None)
    packed = [pack(ks, dev, view, flags, tokens, ns, nr, dr) for ks in sets]
    used = host.used(n)
    (buf, verdict), (other, other_verdict) = packed
    assert verdict == other_verdict
    assert np.array_equal(buf.numpy()[:used], other.numpy()[:used])
    if verdict == 0:
        hbuf = BufferPool(host).take(n)
        host.pack(hbuf.numpy(), view, tokens, ns, nr, dr)
        assert np.array_equal(buf.numpy()[:used], hbuf.numpy()[:used])
    mine = view
    if case["corrupt"] == "view":
        assert view.computed_np is not None and view.slot_need_np is not None
        computed = view.computed_np.copy()
        computed[int(rng.integers(n))] += 1
        mine = FrameView(view.seq, n, view.idx_digest, view.slot_need_np, computed,
                         view.sample_width)
    elif case["corrupt"] is not None:
        at = {"header": int(rng.integers(0, 7)), "checksum": 7,
              "facts": HEADER_WORDS + int(rng.integers(n)) * host.row_width
                       + host.columns.num_computed.offset,
              "payload": HEADER_WORDS + int(rng.integers(n * host.row_width))}[case["corrupt"]]
        buf[at] ^= 1 << int(rng.integers(0, 62))
    got = []
    for ks in sets:
        table = (None if case["table"] is None or not k
                 else torch.full((16, k), -5, dtype=case["table"]))
        before = None if table is None else table.clone()
        v, out = release(ks, dev, buf.clone(), mine, case["keep"], case["expect"], table)
        if v:  # a failed check releases no token and leaves the table
            assert_released_nothing(out, table, before)
        got.append((v, [None if t is None else t.numpy().tolist()
                        for t in (out.tokens, out.counts, out.idx_mapping, out.drafts, table)]))
    assert got[0] == got[1], (case["corrupt"], got[0][0], got[1][0])
