"""The fused device kernels, in Triton (the extra ``ppsync[triton]``).

Each is one program (grid (1,)): a frame is small (a header and up to
max_num_reqs rows of W words), and one program can reduce the whole
checksum and verdict without atomics. It walks the rows in tiles of BR rows
by BW columns (BW: W rounded up to a power of two). The row's columns come
as constexprs from the layout's Columns (ppsync.core.codec.device_kernels.triton_set):
TOK, NS, NR, DR, SN, NC each column's first word, L and K the token and
draft columns' widths, W the row's; a word in none of them (a spare column)
is packed as 0. Integer
arithmetic is int64 and wraps mod 2**64, as numpy's and torch's do, so the
checksum equals the host codec's word for word.

Layouts: ppsync.core.frame.layout (the frame; Staging, the host facts'
device copy ``stage``). Verdict bits: ppsync.core.frame.device_frames.
Importing this module imports Triton; set TRITON_INTERPRET=1 before the
process starts to run the kernels on CPU tensors (the tests do).
"""

from __future__ import annotations

import triton
import triton.language as tl

PACK_RUNTIME = ("buf_ptr", "stage_ptr", "fw_ptr", "tok_ptr", "ns_ptr", "nr_ptr", "dr_ptr",
                "verdict_ptr", "n", "w", "tok_s0", "tok_s1", "ns_s", "nr_s", "dr_s0", "dr_s1")
RELEASE_RUNTIME = ("buf_ptr", "stage_ptr", "fw_ptr", "tok_ptr", "cnt_ptr", "idx_ptr", "dr_ptr",
                   "tab_ptr", "verdict_ptr", "n", "w", "kept", "expect", "tab_s0", "tab_s1")
"""Each kernel's per-step arguments, none specialized on: Triton would
otherwise compile a variant per value class (an int == 1 becomes a constant,
one divisible by 16 and a pointer aligned to 16 bytes get an attribute), so
a new row count, width or view offset would compile mid-serving.
``do_not_specialize`` drops both for a pointer too (Triton 3.9's
``native_specialize_impl``); ``do_not_specialize_on_alignment`` drops the
alignment only. What remains in a kernel's key: the constexprs (the flags)
and the pointers' dtypes."""


@triton.jit(do_not_specialize=PACK_RUNTIME)
def pack_frame(
    buf_ptr, stage_ptr, fw_ptr, tok_ptr, ns_ptr, nr_ptr, dr_ptr, verdict_ptr,
    n, w, tok_s0, tok_s1, ns_s, nr_s, dr_s0, dr_s1,
    TOK: tl.constexpr, L: tl.constexpr, NS: tl.constexpr, NR: tl.constexpr,
    DR: tl.constexpr, K: tl.constexpr, SN: tl.constexpr, NC: tl.constexpr, W: tl.constexpr,
    HAS_DRAFTS: tl.constexpr, HW: tl.constexpr,
    BOUNDS: tl.constexpr, FACTS: tl.constexpr, FLAG_BAD: tl.constexpr,
    BR: tl.constexpr, BW: tl.constexpr,
):
    """The last rank's step: the frame, its checksum and its verdict."""
    c = tl.arange(0, BW)[None, :]
    in_tok = (c >= TOK) & (c < TOK + w)
    pad = (c >= TOK + w) & (c < TOK + L)  # tokens beyond the step's width: -1
    is_sn = c == SN
    is_fact = is_sn | (c == NC)
    fcol = 1 - is_sn.to(tl.int64)  # the staged pair: 0 slot_need, 1 num_computed
    max_ns = tl.load(stage_ptr + BOUNDS)
    max_nr = tl.load(stage_ptr + BOUNDS + 1)
    acc = tl.zeros([BR, BW], dtype=tl.int64)
    bad_ns = tl.zeros([BR], dtype=tl.int64)
    bad_nr = tl.zeros([BR], dtype=tl.int64)
    for r0 in range(0, n, BR):
        rows = r0 + tl.arange(0, BR)
        rm = rows < n
        r = rows[:, None]
        rm2 = rm[:, None]
        val = tl.load(tok_ptr + r * tok_s0 + (c - TOK) * tok_s1, mask=rm2 & in_tok,
                      other=0).to(tl.int64)
        val = tl.where(pad, -1, val)
        nsv = tl.load(ns_ptr + rows * ns_s, mask=rm, other=0).to(tl.int64)
        nrv = tl.load(nr_ptr + rows * nr_s, mask=rm, other=0).to(tl.int64)
        bad_ns |= ((nsv < 0) | (nsv > max_ns)).to(tl.int64)
        bad_nr |= ((nrv < 0) | (nrv > max_nr)).to(tl.int64)
        val = tl.where(c == NS, nsv[:, None], val)
        val = tl.where(c == NR, nrv[:, None], val)
        if K > 0:
            in_dr = (c >= DR) & (c < DR + K)
            if HAS_DRAFTS:
                drv = tl.load(dr_ptr + r * dr_s0 + (c - DR) * dr_s1, mask=rm2 & in_dr,
                              other=-1).to(tl.int64)
                val = tl.where(in_dr, drv, val)
            else:
                val = tl.where(in_dr, -1, val)
        fv = tl.load(stage_ptr + FACTS + 2 * r + fcol, mask=rm2 & is_fact, other=0)
        val = tl.where(is_fact, fv, val)
        m = rm2 & (c < W)
        at = HW + r * W + c
        tl.store(buf_ptr + at, val, mask=m)
        acc += val * tl.load(fw_ptr + at, mask=m, other=0)
    verdict = tl.max(bad_ns, axis=0) + 2 * tl.max(bad_nr, axis=0)
    hc = tl.arange(0, HW)
    head = tl.load(stage_ptr + hc)  # the staged header; its checksum word is 0
    head = tl.where(hc == 5, head | tl.where(verdict != 0, FLAG_BAD, 0), head)
    csum = tl.sum(tl.sum(acc, axis=1), axis=0) + tl.sum(head * tl.load(fw_ptr + hc), axis=0)
    tl.store(buf_ptr + hc, tl.where(hc == HW - 1, csum, head))
    tl.store(verdict_ptr, verdict)


@triton.jit(do_not_specialize=RELEASE_RUNTIME)
def check_release(
    buf_ptr, stage_ptr, fw_ptr, tok_ptr, cnt_ptr, idx_ptr, dr_ptr, tab_ptr, verdict_ptr,
    n, w, kept, expect, tab_s0, tab_s1,
    TOK: tl.constexpr, L: tl.constexpr, NS: tl.constexpr, NR: tl.constexpr,
    DR: tl.constexpr, K: tl.constexpr, SN: tl.constexpr, NC: tl.constexpr, W: tl.constexpr,
    HAND_DRAFTS: tl.constexpr, HAS_TABLE: tl.constexpr,
    HW: tl.constexpr, BOUNDS: tl.constexpr, FACTS: tl.constexpr, IDX_OUT: tl.constexpr,
    KEPT_SLOTS: tl.constexpr, KEPT_ROWS: tl.constexpr, FLAG_BAD: tl.constexpr,
    FLAG_DRAFTS: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr,
):
    """A receiver's step: check the frame against this rank's view, then
    release it (tokens, counts, idx_mapping, drafts; kept drafts into the
    table): two passes over the rows, so the verdict is whole before the
    first write; a frame that fails releases no token and writes no table.
    ``expect``: 1 / 0 the frame must (not) have drafts, -1 either."""
    c = tl.arange(0, BW)[None, :]
    is_sn = c == SN
    is_fact = is_sn | (c == NC)
    fcol = 1 - is_sn.to(tl.int64)  # the staged pair: 0 slot_need, 1 num_computed
    hc = tl.arange(0, HW)
    head = tl.load(buf_ptr + hc)
    exp = tl.load(stage_ptr + hc)
    # every header word but the flags and the checksum must be this rank's
    bad_frame = tl.max(((head != exp) & (hc != 5) & (hc != HW - 1)).to(tl.int64), axis=0)
    flags = tl.sum(tl.where(hc == 5, head, 0), axis=0)
    sent_csum = tl.sum(tl.where(hc == HW - 1, head, 0), axis=0)
    hw = tl.load(fw_ptr + hc)
    max_ns = tl.load(stage_ptr + BOUNDS)
    max_nr = tl.load(stage_ptr + BOUNDS + 1)
    acc = tl.zeros([BR, BW], dtype=tl.int64)
    bad_rows = tl.zeros([BR], dtype=tl.int64)
    bad_ns = tl.zeros([BR], dtype=tl.int64)
    bad_nr = tl.zeros([BR], dtype=tl.int64)
    # pass 1: the check, reduced to the verdict before anything is released
    for r0 in range(0, n, BR):
        rows = r0 + tl.arange(0, BR)
        rm = rows < n
        r = rows[:, None]
        rm2 = rm[:, None]
        m = rm2 & (c < W)
        at = HW + r * W + c
        val = tl.load(buf_ptr + at, mask=m, other=0)
        acc += val * tl.load(fw_ptr + at, mask=m, other=0)
        fv = tl.load(stage_ptr + FACTS + 2 * r + fcol, mask=rm2 & is_fact, other=0)
        bad_rows |= tl.max((is_fact & rm2 & (val != fv)).to(tl.int64), axis=1)
        nsv = tl.sum(tl.where(c == NS, val, 0), axis=1)
        nrv = tl.sum(tl.where(c == NR, val, 0), axis=1)
        bad_ns |= (rm & ((nsv < 0) | (nsv > max_ns))).to(tl.int64)
        bad_nr |= (rm & ((nrv < 0) | (nrv > max_nr))).to(tl.int64)
    csum = tl.sum(tl.sum(acc, axis=1), axis=0) + tl.sum(head * hw, axis=0)
    bad_frame |= tl.max(bad_rows, axis=0) | (csum != sent_csum).to(tl.int64)
    has = ((flags & FLAG_DRAFTS) != 0).to(tl.int64)
    verdict = (bad_frame * 4 + ((flags & FLAG_BAD) != 0).to(tl.int64) * 8
               + tl.max(bad_ns, axis=0) + 2 * tl.max(bad_nr, axis=0)
               + ((expect >= 0) & (has != expect)).to(tl.int64) * 16)
    tl.store(verdict_ptr, verdict)
    # pass 2: the release; a failed frame releases nothing (every row
    # excluded, num_sampled 0, tokens and drafts -1, no table write)
    ok = verdict == 0
    for r0 in range(0, n, BR):
        rows = r0 + tl.arange(0, BR)
        rm = rows < n
        r = rows[:, None]
        rm2 = rm[:, None]
        val = tl.load(buf_ptr + HW + r * W + c, mask=rm2 & (c < W), other=0)
        nsv = tl.sum(tl.where(c == NS, val, 0), axis=1)
        nrv = tl.sum(tl.where(c == NR, val, 0), axis=1)
        val = tl.where(ok, val, -1)
        tl.store(tok_ptr + r * w + (c - TOK), val, mask=rm2 & (c >= TOK) & (c < TOK + w))
        tl.store(cnt_ptr + rows, tl.where(ok, nsv, 0).to(tl.int32), mask=rm)
        tl.store(cnt_ptr + n + rows, tl.where(ok, nrv, 0).to(tl.int32), mask=rm)
        idx = tl.load(stage_ptr + IDX_OUT + rows, mask=rm, other=0)
        tl.store(idx_ptr + rows, tl.where(ok, idx, -1), mask=rm)
        if HAND_DRAFTS:
            in_dr = (c >= DR) & (c < DR + K)
            tl.store(dr_ptr + r * K + (c - DR), val, mask=rm2 & in_dr)
    if HAS_TABLE:
        d = tl.arange(0, BK)[None, :]
        upto = kept * has * ok.to(tl.int64)  # without drafts, or failed: no write
        for k0 in range(0, upto, BR):
            ks = k0 + tl.arange(0, BR)
            km = (ks < upto)[:, None] & (d < K)
            slot = tl.load(stage_ptr + KEPT_SLOTS + ks, mask=ks < upto, other=0)[:, None]
            row = tl.load(stage_ptr + KEPT_ROWS + ks, mask=ks < upto, other=0)[:, None]
            drv = tl.load(buf_ptr + HW + row * W + DR + d, mask=km, other=0)
            tl.store(tab_ptr + slot * tab_s0 + d * tab_s1, drv, mask=km)
