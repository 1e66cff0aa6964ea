"""ppsync.core.path.handshake: the configuration words every rank compares."""

from __future__ import annotations

from typing import get_args

from ppsync.core.path.handshake import CARRIER_CODES, KERNEL_SET_CODES, _word, config_words
from ppsync.core.wire.backends import CARRIERS
from ppsync.schemas.config import CarrierName, DeviceKernelsName, SyncConfig


def test_every_device_kernel_set_has_its_own_code() -> None:
    sets = [n for n in get_args(DeviceKernelsName) if n != "auto"]
    assert set(sets) <= set(KERNEL_SET_CODES) and "none" in KERNEL_SET_CODES
    assert len(set(KERNEL_SET_CODES.values())) == len(KERNEL_SET_CODES)
    # codes given once are fixed: another release's rank reads them alike
    assert KERNEL_SET_CODES["none"] == 0 and KERNEL_SET_CODES["torch"] == 1
    assert KERNEL_SET_CODES["triton"] == 2


def test_the_kernel_set_word_is_its_code_and_reads_back_by_name() -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=4, codec="device")
    for name, code in KERNEL_SET_CODES.items():
        assert config_words(config, on_device=True, device_kernels=name)[-2] == code
        assert _word("device_kernels", code) == name
    assert _word("device_kernels", 99) == "99"


def test_the_carrier_word_names_the_device_codecs_carrier() -> None:
    # every carrier declared has a code, and the config names the same ones
    assert set(CARRIER_CODES) == {c.name for c in CARRIERS} == set(get_args(CarrierName))
    assert len(set(CARRIER_CODES.values()) | {0}) == len(CARRIER_CODES) + 1
    for name, code in CARRIER_CODES.items():
        config = SyncConfig.build(pp_size=2, max_num_reqs=4, codec="device", carrier=name)
        assert config_words(config, on_device=True, device_kernels="torch")[-1] == code
        assert _word("carrier", code) == name
    # the host codec's frames are host frames whatever the carrier says
    host = SyncConfig.build(pp_size=2, max_num_reqs=4, codec="host", carrier="device")
    assert config_words(host, on_device=False, device_kernels="none")[-1] == 0
