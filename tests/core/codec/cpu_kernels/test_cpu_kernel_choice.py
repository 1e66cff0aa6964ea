"""SyncConfig.cpu_kernels, chosen once: "auto" takes numba where it loads
and the numpy reference where it does not; "numba" where it does not is a
ConfigError naming the field, the value and the way out."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ppsync.core.codec.cpu_kernels import numba_error
from ppsync.core.codec.host import HostCodec
from ppsync.schemas.config import SyncConfig


def _codec(kernels: str) -> HostCodec:
    return HostCodec(SyncConfig.build(pp_size=2, max_num_reqs=4,
                                      cpu_kernels=kernels))


def test_numpy_is_the_reference_everywhere() -> None:
    assert _codec("numpy").kernels.name == "numpy"


@pytest.mark.skipif(numba_error() is not None, reason=f"numba cannot load: {numba_error()}")
def test_auto_and_numba_take_numba_where_it_loads() -> None:
    assert _codec("auto").kernels.name == "numba"
    assert _codec("numba").kernels.name == "numba"


BREAKS = {
    # as on a platform with no numba wheel
    "no numba": 'sys.modules["numba"] = None  # import numba raises ImportError',
    # numba compiles at import: a cache it cannot load raises there (seen: a
    # cache written by another numba on one source tree shared by two venvs)
    "a cache numba cannot load": (
        "import numba\n"
        "def njit(*a, **k):\n"
        "    raise RuntimeError('LLVM bitcode parsing error')\n"
        "numba.njit = njit"),
}


@pytest.mark.parametrize("breaks", sorted(BREAKS))
def test_without_numba_auto_serves_numpy_and_numba_is_a_config_error(breaks: str) -> None:
    """A real interpreter where loading the numba kernels fails."""
    if breaks != "no numba" and numba_error() is not None:
        pytest.skip(f"numba cannot load here: {numba_error()}")
    script = "import sys\n" + BREAKS[breaks] + textwrap.dedent("""
        from ppsync.core.codec.host import HostCodec
        from ppsync.errors import ConfigError
        from ppsync.schemas.config import SyncConfig
        cfg = lambda k: SyncConfig.build(pp_size=2, max_num_reqs=4, cpu_kernels=k)
        print("auto:", HostCodec(cfg("auto")).kernels.name)
        try:
            HostCodec(cfg("numba"))
        except ConfigError as e:
            print("numba:", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "auto: numpy" in out, out
    assert "numba: cpu_kernels = 'numba' but numba cannot be loaded" in out, out
    assert "ppsync[jit]" in out, out
