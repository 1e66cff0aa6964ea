"""ppsync.schemas.records: StepRecord validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ppsync.errors import BatchError
from ppsync.schemas._validate import validate_as
from ppsync.schemas.records import StepRecord


def _record(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "step": 7, "num_reqs": 4, "num_needed": 3, "sample_width": 3, "num_drafts": 2,
    }
    base.update(fields)
    return base


def test_step_record_valid_with_defaults() -> None:
    rec = StepRecord.model_validate(_record())
    assert rec.step == 7
    assert rec.num_needed == 3
    assert rec.has_drafts is False
    assert rec.idx_digest == 0


def test_step_record_allows_every_row_needed_and_none_needed() -> None:
    assert StepRecord.model_validate(_record(num_needed=4)).num_needed == 4
    assert StepRecord.model_validate(_record(num_reqs=0, num_needed=0)).num_reqs == 0


def test_step_record_rejects_more_needed_than_rows() -> None:
    with pytest.raises(ValidationError, match=r"num_needed = 5 exceeds num_reqs = 4"):
        StepRecord.model_validate(_record(num_needed=5))


@pytest.mark.parametrize(("width", "k"), [(2, 2), (4, 2), (1, 1), (2, 0)])
def test_step_record_rejects_width_other_than_k_plus_one(width: int, k: int) -> None:
    with pytest.raises(
        ValidationError, match=rf"sample_width = {width} must equal num_drafts \+ 1 = {k + 1}"
    ):
        StepRecord.model_validate(_record(sample_width=width, num_drafts=k))


@pytest.mark.parametrize("field", ["step", "num_reqs", "num_needed", "num_drafts"])
def test_step_record_rejects_negative_counts(field: str) -> None:
    with pytest.raises(ValidationError, match=rf"{field}\n.*greater than or equal to 0"):
        StepRecord.model_validate(_record(**{field: -1}))


def test_step_record_forbids_extra_fields() -> None:
    with pytest.raises(ValidationError, match=r"tokens\n.*Extra inputs are not permitted"):
        StepRecord.model_validate(_record(tokens=[1, 2]))


def test_step_record_is_frozen() -> None:
    rec = StepRecord.model_validate(_record())
    with pytest.raises(ValidationError, match="frozen"):
        rec.step = 8
    assert rec.step == 7


def test_step_record_errors_convert_to_ppsync_errors() -> None:
    with pytest.raises(
        BatchError, match=r"invalid StepRecord: .*num_needed = 5 exceeds num_reqs = 4"
    ):
        validate_as(StepRecord, _record(num_needed=5), BatchError)
    assert validate_as(StepRecord, _record(), BatchError).num_reqs == 4


def test_step_record_json_round_trip() -> None:
    rec = StepRecord.model_validate(_record(has_drafts=True, idx_digest=-99))
    assert StepRecord.model_validate_json(rec.model_dump_json()) == rec
