"""CPU rehearsal mode: Megatron-Core's 3D-parallel stack on CPU with gloo.

Each workaround is listed in `workarounds.WORKAROUNDS` with the reason it exists; tests in
tests/test_rehearsal_workarounds.py fail when one stops being needed or stops working.
"""

from deadpool_megatron.rehearsal.imports import prepare_megatron_import
from deadpool_megatron.rehearsal.cuda_shim import CpuRehearsal, rehearsal_needed
from deadpool_megatron.rehearsal.workarounds import WORKAROUNDS, Workaround

__all__ = [
    "CpuRehearsal",
    "WORKAROUNDS",
    "Workaround",
    "prepare_megatron_import",
    "rehearsal_needed",
]
