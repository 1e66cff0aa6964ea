"""ppsync.core.wire.transport.translate: torch.distributed failures as ppsync's
typed errors, torch's own error types tried before gloo's message text."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ppsync.core.wire.transport import translate
from ppsync.errors import PeerLost, SyncTimeout


def test_a_network_error_is_a_lost_peer_whatever_its_text() -> None:
    err = translate(dist.DistNetworkError("recv failed"), what="rank 0: receive",
                    timeout_s=1.0, peer=2)
    assert isinstance(err, PeerLost) and err.peer == 2
    assert str(err) == "rank 0: receive: peer rank 2 is gone (recv failed)"


def test_a_store_error_is_a_timeout_whatever_its_text() -> None:
    err = translate(dist.DistStoreError("wait for key 'x'"), what="rank 1: receive",
                    timeout_s=3.0, peer=None)
    assert isinstance(err, SyncTimeout)
    assert str(err) == ("rank 1: receive: no completion within timeout_s = 3.0 "
                        "(wait for key 'x')")


@pytest.mark.parametrize(
    ("text", "kind", "message"),
    [
        # gloo on CPU raises plain RuntimeErrors: its text decides
        ("Operation timed out!", SyncTimeout, "no completion within timeout_s = 2.0"),
        ("[pair.cc:553] Connection closed by peer [127.0.0.1]:1", PeerLost,
         "a peer rank is gone"),
        ("something else", PeerLost, "transfer failed"),
    ],
)
def test_gloo_runtime_errors_are_read_by_their_text(
    text: str, kind: type[Exception], message: str
) -> None:
    err = translate(RuntimeError(text), what="w", timeout_s=2.0, peer=None)
    assert isinstance(err, kind)
    assert message in str(err)


def test_a_backend_error_is_read_by_its_text() -> None:
    timed = translate(dist.DistBackendError("Watchdog caught collective operation timeout"),
                      what="w", timeout_s=2.0, peer=None)
    assert isinstance(timed, SyncTimeout)
    other = translate(dist.DistBackendError("NCCL error: unhandled system error"),
                      what="w", timeout_s=2.0, peer=1)
    assert isinstance(other, PeerLost) and "transfer failed" in str(other)
