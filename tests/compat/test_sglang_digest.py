"""The SGLang guard's view of a PP message and its comparison, and the
plugin's switches: pure Python, no SGLang needed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ppsync.compat.sglang.digest import FIELDS, StepView, check_views, first_difference, view_of
from ppsync.compat.sglang.guard import GuardOptions, Perturb
from ppsync.compat.sglang.plugin import SUPPORTED, check_release, register
from ppsync.errors import ConfigError, DesyncError


@dataclass
class Kv:
    req_pool_idx: int | None


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]
    kv: Kv


@dataclass
class Batch:
    reqs: list[Req] = field(default_factory=list)
    forward_mode: int = 2


def _batch(*rids: str, slots: tuple[int, ...] = ()) -> Batch:
    slots = slots or tuple(range(len(rids)))
    return Batch([Req(r, [1, 2, 3], [4], Kv(s)) for r, s in zip(rids, slots, strict=True)])


def test_equal_batches_give_equal_views() -> None:
    a, b = view_of(_batch("x", "y"), "proxy", 3), view_of(_batch("x", "y"), "proxy", 3)
    assert a == b
    assert first_difference(a, b) is None
    check_views(a, b, stage=1, sender=0)  # no error


@pytest.mark.parametrize(("mine", "theirs", "field_name"), [
    (_batch("x", "y"), _batch("y", "x"), "rids"),
    (_batch("x", "y"), _batch("x"), "num_reqs"),
    (_batch("x", "y"), _batch("x", "y", slots=(0, 5)), "slots"),
])
def test_first_differing_field_is_named(mine: Batch, theirs: Batch, field_name: str) -> None:
    a, b = view_of(mine, "output", 7), view_of(theirs, "output", 7)
    assert first_difference(a, b) == field_name
    with pytest.raises(DesyncError, match=rf"SGLang PP stage 1: output message 7 from stage 0: "
                       rf"first differing field {field_name}: "):
        check_views(a, b, stage=1, sender=0)


def test_token_counts_and_mode_and_step_are_compared() -> None:
    base = _batch("x")
    more = _batch("x")
    more.reqs[0].output_ids.append(9)
    assert first_difference(view_of(base, "proxy", 0), view_of(more, "proxy", 0)) == "tokens"
    other_mode = _batch("x")
    other_mode.forward_mode = 1
    assert first_difference(view_of(base, "proxy", 0),
                            view_of(other_mode, "proxy", 0)) == "mode"
    assert first_difference(view_of(base, "proxy", 0), view_of(base, "proxy", 1)) == "step"
    assert first_difference(view_of(base, "proxy", 0), view_of(base, "output", 0)) == "kind"


def test_desync_error_carries_both_views() -> None:
    a, b = view_of(_batch("x"), "proxy", 2), view_of(_batch("z"), "proxy", 2)
    with pytest.raises(DesyncError) as info:
        check_views(a, b, stage=1, sender=0)
    assert info.value.expected == dict(zip(FIELDS, a.as_tuple(), strict=True))
    assert info.value.received == dict(zip(FIELDS, b.as_tuple(), strict=True))


def test_no_batch_is_an_empty_view() -> None:
    v = view_of(None, "output", 0)
    assert (v.num_reqs, v.tokens, v.mode) == (0, 0, -1)


def test_a_view_travels_as_ints_and_a_foreign_one_is_a_desync() -> None:
    v = view_of(_batch("x"), "proxy", 4)
    assert StepView.from_tuple(v.as_tuple()) == v
    with pytest.raises(DesyncError, match="is not a tuple of 8 ints"):
        StepView.from_tuple(None)
    with pytest.raises(DesyncError, match="is not a tuple of 8 ints"):
        StepView.from_tuple((1, 2))


def test_perturb_names_its_rule() -> None:
    assert Perturb.parse("1:proxy:2") == Perturb(1, "proxy", 2)
    for bad in ("1:proxy", "1:hidden:2", "a:proxy:2", "-1:output:0"):
        with pytest.raises(ConfigError, match=r"PPSYNC_SGLANG_PERTURB = .* must be STAGE:KIND"):
            Perturb.parse(bad)


def test_options_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPSYNC_TIMEOUT_S", "2.5")
    monkeypatch.setenv("PPSYNC_SGLANG_CHECK", "0")
    monkeypatch.setenv("PPSYNC_SGLANG_PERTURB", "0:output:3")
    monkeypatch.setenv("PPSYNC_SILENT_S", "4")
    assert GuardOptions.from_env() == GuardOptions(2.5, 4.0, False, Perturb(0, "output", 3))
    for bad in ("0", "-1", "x", "1e9"):
        monkeypatch.setenv("PPSYNC_TIMEOUT_S", bad)
        with pytest.raises(ConfigError, match=r"PPSYNC_TIMEOUT_S = .* must be a number of "
                           r"seconds in \(0, 86400\]"):
            GuardOptions.from_env()


def test_release_check_refuses_others_in_one_line() -> None:
    assert check_release(SUPPORTED[0]) == SUPPORTED[0]
    with pytest.raises(ConfigError,
                       match=r"supports SGLang 0\.5\.23, not the installed 0\.5\.9") as e:
        check_release("0.5.9")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="SGLang is not installed"):
        check_release(None)


def test_register_is_a_no_op_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    before = (dist.irecv, dist.isend)
    for value in (None, "0", "yes"):
        if value is None:
            monkeypatch.delenv("PPSYNC_SGLANG", raising=False)
        else:
            monkeypatch.setenv("PPSYNC_SGLANG", value)
        register()  # no SGLang here: anything but a no-op would raise
        assert (dist.irecv, dist.isend) == before


def test_switched_on_without_sglang_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    try:
        metadata.version("sglang")
        pytest.skip("SGLang is installed here: the refusal of a missing SGLang cannot show")
    except metadata.PackageNotFoundError:
        pass
    monkeypatch.setenv("PPSYNC_SGLANG", "1")
    with pytest.raises(ConfigError, match="PPSYNC_SGLANG=1 but SGLang is not installed here"):
        register()
