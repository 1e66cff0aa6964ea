"""A stand-in vLLM module tree for the adapter's and the plugin's tests.

vLLM itself is not installed in CI (gigabytes, and its V2 runner needs a
Triton backend), so the tests write a small package with vLLM's module names
into a temp dir and put it on ``sys.path`` (inside rank processes, or under
a fixture that removes it again). Only the names ppsync touches exist, each
with the call shape vLLM's source has (facts, not vLLM's code):

- ``vllm.distributed.parallel_state.get_pp_group()``: the PP group, with
  ``device_group``, ``world_size``, ``is_first_rank``, ``is_last_rank``;
- ``vllm.v1.worker.gpu.pp_utils.PPHandler``: vLLM's own handler (here: a
  class that only records that it was built);
- ``vllm.v1.worker.gpu.model_runner``: binds ``PPHandler`` from pp_utils at
  import and builds it with keywords ``max_num_reqs``,
  ``num_speculative_steps``, ``device``;
- ``vllm.v1.worker.cpu.pp_utils.PPHandler`` and
  ``vllm.v1.worker.cpu.standalone_model_runner`` (vLLM 0.34's standalone CPU
  runner): the same, built with keywords ``max_num_reqs``, ``device``;
- ``vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils
  .aux_hidden_state_relay_keys(model)``: empty on the first and the last PP
  stage, else the model's keys (here: the model's ``aux_keys``);
- ``vllm.sequence.IntermediateTensors``: a dataclass with ``tensors`` and
  ``kv_connector_output``.

Optionally a ``.dist-info`` makes ``importlib.metadata`` report a version.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

FILES = {
    "vllm/__init__.py": '"""Stand-in for tests (not vLLM)."""\n',
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": '''
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class PPGroup:
    device_group: dist.ProcessGroup

    @property
    def world_size(self):
        return dist.get_world_size(self.device_group)

    @property
    def is_first_rank(self):
        return dist.get_rank(self.device_group) == 0

    @property
    def is_last_rank(self):
        return dist.get_rank(self.device_group) == self.world_size - 1


def get_pp_group():
    return PPGroup(dist.group.WORLD)
''',
    "vllm/sequence.py": '''
from dataclasses import dataclass


@dataclass
class IntermediateTensors:
    tensors: dict
    kv_connector_output: object = None
''',
    "vllm/v1/__init__.py": "",
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/gpu/__init__.py": "",
    "vllm/v1/worker/gpu/pp_utils.py": '''
class PPHandler:
    """vLLM's own handler, stood in: the tests only see that it was built."""

    standin = True

    def __init__(self, max_num_reqs, num_speculative_steps, device):
        self.args = (max_num_reqs, num_speculative_steps, device)
''',
    "vllm/v1/worker/gpu/model_runner.py": '''
from vllm.v1.worker.gpu.pp_utils import PPHandler


class GPUModelRunner:
    def __init__(self, max_num_reqs, num_speculative_steps, device):
        self.pp_handler = PPHandler(
            max_num_reqs=max_num_reqs,
            num_speculative_steps=num_speculative_steps,
            device=device,
        )
''',
    "vllm/v1/worker/cpu/__init__.py": "",
    "vllm/v1/worker/cpu/pp_utils.py": '''
class PPHandler:
    """vLLM's own CPU runner handler, stood in."""

    standin = True

    def __init__(self, max_num_reqs, device):
        self.args = (max_num_reqs, device)
''',
    "vllm/v1/worker/cpu/standalone_model_runner.py": '''
from vllm.v1.worker.cpu.pp_utils import PPHandler


class CPUModelRunner:
    def __init__(self, max_num_reqs, device):
        self.pp_handler = PPHandler(max_num_reqs=max_num_reqs, device=device)
''',
    "vllm/v1/worker/gpu/spec_decode/__init__.py": "",
    "vllm/v1/worker/gpu/spec_decode/eagle/__init__.py": "",
    "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py": '''
from vllm.distributed.parallel_state import get_pp_group


def aux_hidden_state_relay_keys(model):
    pp = get_pp_group()
    if pp.world_size < 2 or pp.is_first_rank or pp.is_last_rank:
        return ()
    return tuple(model.aux_keys)
''',
}


def write_standin(root: Path, *, dist_name: str | None = None, version: str = "") -> Path:
    """Write the tree under ``root``; with ``dist_name``, also a dist-info
    saying that ``dist_name`` ``version`` is installed. Returns ``root``."""
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if dist_name is not None:
        write_dist_info(root, dist_name, version)
    return root


def write_dist_info(root: Path, dist_name: str, version: str) -> None:
    """An installed-distribution record that importlib.metadata finds."""
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n"
    )


def use_standin(root: Path) -> None:
    """Put the tree first on ``sys.path`` (in a rank process: no clean-up)."""
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()


def drop_vllm_modules() -> None:
    """Forget every imported ``vllm`` module (a fixture's clean-up)."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
