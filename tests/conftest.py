"""Test-wide settings made before any test module imports a library."""

import os

# Triton compiles for CUDA / XPU only; its interpreter runs the device
# kernels on CPU tensors here (a GPU run sets TRITON_INTERPRET=0 itself).
# Set before anything imports triton: its JIT reads it at decoration.
os.environ.setdefault("TRITON_INTERPRET", "1")
