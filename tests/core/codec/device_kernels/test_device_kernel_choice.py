"""SyncConfig.device_kernels, chosen once: "auto" takes Triton only where it
imports and the device is CUDA or XPU, torch ops elsewhere; "triton" where it
cannot run is a ConfigError naming the field, the value and the way out;
and without Triton installed, make test's Triton tests skip saying why."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from ppsync.core.codec.device_kernels import resolve_device_kernels, triton_error
from ppsync.errors import ConfigError
from ppsync.schemas.config import SyncConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _config(kernels: str) -> SyncConfig:
    return SyncConfig.build(pp_size=2, max_num_reqs=4, codec="device", device_kernels=kernels)


def test_torch_ops_are_the_reference_everywhere() -> None:
    assert resolve_device_kernels(_config("torch"), CUDA) == "torch"
    assert resolve_device_kernels(_config("auto"), CPU) == "torch"  # even with Triton here


@pytest.mark.skipif(triton_error() is not None, reason=f"Triton cannot load: {triton_error()}")
def test_auto_takes_triton_on_a_gpu_and_triton_on_cpu_needs_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device_kernels(_config("auto"), CUDA) == "triton"
    assert resolve_device_kernels(_config("triton"), CPU) == "triton"  # TRITON_INTERPRET=1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"device_kernels = 'triton' on a cpu device needs "
                       r"Triton's interpreter \(TRITON_INTERPRET=1"):
        resolve_device_kernels(_config("triton"), CPU)


def test_without_triton_auto_serves_torch_and_triton_is_a_config_error() -> None:
    """A real interpreter where ``import triton`` fails (as where the extra
    is not installed); the tests that need Triton skip there, saying why."""
    script = textwrap.dedent("""
        import sys, torch
        sys.modules["triton"] = None  # import triton raises ImportError
        from ppsync.core.codec.device_kernels import resolve_device_kernels
        from ppsync.errors import ConfigError
        from ppsync.schemas.config import SyncConfig
        cfg = lambda k: SyncConfig.build(pp_size=2, max_num_reqs=4, codec="device",
                                         device_kernels=k)
        print("auto:", resolve_device_kernels(cfg("auto"), torch.device("cuda")))
        try:
            resolve_device_kernels(cfg("triton"), torch.device("cuda"))
        except ConfigError as e:
            print("triton:", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "auto: torch" in out, out
    assert "triton: device_kernels = 'triton' but Triton cannot be loaded" in out, out
    assert "ppsync[triton]" in out, out


def test_make_test_without_triton_skips_the_triton_tests_and_says_why() -> None:
    """The frame tests in a pytest where ``import triton`` fails: the torch
    set's pass, the Triton set's are skipped with the reason."""
    plugin = "import sys\nsys.modules['triton'] = None\n"
    run = subprocess.run(
        [sys.executable, "-c", plugin + "import pytest, sys; sys.exit(pytest.main(["
         "'-q', '-rs', '-p', 'no:cacheprovider', "
         "'tests/core/frame/test_device_frames.py', '-k', 'other_view'"
         "]))"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "1 passed, 1 skipped" in run.stdout, run.stdout[-2000:]
    assert "Triton cannot be loaded" in run.stdout and "install ppsync[triton]" in run.stdout
