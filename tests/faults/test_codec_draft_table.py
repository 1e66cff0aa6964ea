"""When ``consume`` raises, for any reason, the caller's draft table is
untouched, on every codec and kernel set (issue 27 finding 2), on real gloo
ranks: the host codecs raise before releasing; a device codec's frame that
fails its check releases no token and writes no table (its error is read
from the verdict, at that consume on CPU)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch
from test_codec_differential import MAX_NUM_REQS, VARIANTS, _variants, variant_path

from ppsync.core import SampledStep
from ppsync.core.rules import BatchView
from ppsync.errors import PPSyncError
from ppsync.harness.launcher import RankEnv, spawn_ranks

RAISE_STEPS, BAD_STEP = 5, 4  # the bad step last: nothing sent after it


def _raising_rank(variant: dict[str, str], case: str, env: RankEnv
                  ) -> list[tuple[int, str | None, bool]]:
    """Steps with drafts on every row, one of them bad: ``desync``: the
    receiver's view of step BAD_STEP differs from the last rank's (a
    DesyncError on every codec); ``values``: the last rank publishes an
    out-of-range num_sampled with drafts (host codecs: a BatchError at the
    publish, then the corrected step; device codecs: sent, flagged, and the
    receiver raises at its consume). Receivers return (step, error type or
    None, whether the table was as before) per consume."""
    k = 2
    path, _ = variant_path(variant, k)
    table = torch.arange(MAX_NUM_REQS * k, dtype=torch.int64).reshape(MAX_NUM_REQS, k) - 50
    rng = np.random.default_rng(3)
    seen: list[tuple[int, str | None, bool]] = []
    for t in range(RAISE_STEPS + 2):
        if not path.is_last:
            before = table.clone()
            try:
                path.consume(table)
                seen.append((t, None, bool(torch.equal(table, before))))
            except PPSyncError as e:
                seen.append((t, type(e).__name__, bool(torch.equal(table, before))))
        if t >= RAISE_STEPS:
            continue
        n = 3
        idx = rng.permutation(MAX_NUM_REQS)[:n].astype(np.int64)
        computed = np.full(n, 10 + t, dtype=np.int64)
        if case == "desync" and t == BAD_STEP and not path.is_last:
            computed[1] += 1
        view = BatchView(num_reqs=n, idx_mapping_np=idx, num_computed_tokens_np=computed,
                         num_scheduled_tokens_np=np.ones(n, dtype=np.int64),
                         prefill_len_np=computed.copy())
        if not path.is_last:
            path.post(view, sample_width=None, expect_drafts=True)
            continue
        tokens = torch.from_numpy(rng.integers(0, 1 << 40, (n, k + 1)).astype(np.int64))
        drafts = torch.from_numpy(rng.integers(0, 1 << 40, (n, k)).astype(np.int64))
        ns = torch.full((n,), 2, dtype=torch.int32)
        nr = torch.ones(n, dtype=torch.int32)
        bad = ns.clone()
        bad[1] = 99
        for num_sampled in ((bad, ns) if case == "values" and t == BAD_STEP else (ns,)):
            try:
                prepared, step_drafts = path.prepare(view, SampledStep(
                    tokens, num_sampled, nr, drafts))
                path.send(prepared, step_drafts)
                break
            except PPSyncError:
                continue
    with contextlib.suppress(PPSyncError):  # the last rank's deferred BatchError
        path.close()
    return seen


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["desync", "values"])
@pytest.mark.parametrize("variant", [pytest.param(VARIANTS[0], id="host,numpy"),
                                     *_variants()])
def test_a_consume_that_raises_leaves_the_draft_table(case: str,
                                                      variant: dict[str, str]) -> None:
    """Issue 27 finding 2: when consume raises, for any reason, the caller's
    draft table is untouched, on every codec and kernel set (the host codec
    raises before releasing; a device codec's failed frame releases nothing)."""
    seen, _ = spawn_ranks(functools.partial(_raising_rank, variant, case), 2, timeout_s=120)
    raised = [s for s in seen if s[1] is not None]
    if case == "desync" or variant["codec"] == "device":
        assert raised, seen  # the bad frame reached a consume: the check bites
    assert all(kept for _, _, kept in raised), seen
    # every consume that released a step wrote the table (the check could see a write)
    assert all(not kept for t, err, kept in seen if err is None and t > 1), seen
