"""What ppsync knows of each torch.distributed backend and of each carrier,
declared once; the platforms, the completion semantics, the twin, the
flags and the plugin's settings read it here.

A new backend (HCCL on Ascend, say) touches: its :class:`Backend` entry
here; its platform class (ppsync.core.wire.platform: streams, events,
pinned memory, in ``_BY_NAME``); with a CPU twin, its name in
``schemas.config.EmulatedName``; and its tests (tests/core/wire/
test_backends.py checks that every list of names agrees with this one).
A new carrier touches: its :class:`Carrier` entry here; its class in
ppsync.core.codec.carriers (``CARRIER_CLASSES``); its name in
``schemas.config.CarrierName``; and its tests.

Facts read from PyTorch's ProcessGroupNCCL / torch-xpu-ops'
ProcessGroupXCCL (docs/design.md, "When they fail"): NCCL's and XCCL's
works complete at enqueue (stream-ordered), gloo's with the transfer; NCCL
can abort a communicator, XCCL cannot (``abortComms`` only logs).
"""

from __future__ import annotations

from dataclasses import dataclass

from ppsync.errors import ConfigError

__all__ = ["BACKENDS", "CARRIERS", "Backend", "Carrier", "backend", "carried_by",
           "device_backend", "twin_names"]


@dataclass(frozen=True)
class Backend:
    """One collective backend, as ppsync uses it."""

    name: str
    """torch.distributed's name for it."""
    device_type: str
    """Where the tensors it carries live (cpu, cuda, xpu)."""
    stream_ordered: bool
    """Its works complete at enqueue; only an event query says a transfer ended."""
    abortable: bool
    """It can abort a communicator (its pending transfers then end)."""
    watchdog: bool
    """A thread of its own ends a communicator whose work outlives the
    group's timeout (NCCL's watchdog); the twin runs one too."""
    timeout_margin_s: float
    """The token group's own timeout is ``max_pending_s`` plus this: ppsync's
    cap (and its abort) comes first, the backend's clock is the last resort."""
    twin: str | None
    """The name of its CPU twin (``--emulate``, ``PPSYNC_EMULATE``); None: none."""


BACKENDS = (
    Backend("gloo", "cpu", stream_ordered=False, abortable=False, watchdog=False,
            timeout_margin_s=60.0, twin=None),
    Backend("nccl", "cuda", stream_ordered=True, abortable=True, watchdog=True,
            timeout_margin_s=60.0, twin="nccl"),
    Backend("xccl", "xpu", stream_ordered=True, abortable=False, watchdog=False,
            timeout_margin_s=60.0, twin="xccl"),
)


@dataclass(frozen=True)
class Carrier:
    """How a device codec's frame travels between ranks."""

    name: str
    """As ``SyncConfig.carrier``, ``--carrier`` and ``PPSYNC_CARRIER`` say it."""
    on_host: bool
    """The frame crosses through pinned host memory over gloo (no kernel of
    the device waits on a peer); else the device's own backend carries it."""


CARRIERS = (
    Carrier("host", on_host=True),
    Carrier("device", on_host=False),
)


def backend(name: str) -> Backend:
    """The backend named ``name``; ConfigError for one ppsync does not know."""
    for b in BACKENDS:
        if b.name == name:
            return b
    raise ConfigError(f"backend {name!r} must be one of {', '.join(b.name for b in BACKENDS)}")


def device_backend(device_type: str) -> Backend:
    """The backend whose tensors live on ``device_type`` devices."""
    for b in BACKENDS:
        if b.device_type == device_type:
            return b
    raise ConfigError(f"no backend carries {device_type} tensors; ppsync knows "
                      f"{', '.join(b.device_type for b in BACKENDS)}")


def carried_by(carrier: str, device_type: str) -> str:
    """The token group's backend for device frames carried by ``carrier``
    from an engine on ``device_type``: gloo through the host, else the
    device's own."""
    for c in CARRIERS:
        if c.name == carrier:
            return "gloo" if c.on_host else device_backend(device_type).name
    raise ConfigError(f"carrier = {carrier!r} must be one of "
                      f"{', '.join(c.name for c in CARRIERS)}")


def twin_names() -> tuple[str, ...]:
    """The backends a CPU twin stands in for (``--emulate``)."""
    return tuple(b.twin for b in BACKENDS if b.twin is not None)
