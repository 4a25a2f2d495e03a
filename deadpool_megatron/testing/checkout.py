"""Test-only: a user's Megatron-LM checkout, laid out from the megatron-core wheel, which
ships `megatron/training` (at core_r0.19.0 byte-identical to the checkout's) but not the
repository's root scripts or the datasets' Makefile. Its `pretrain_gpt.py` is
megatron_lm_driver.py, which provides `typing.override` (new in Python 3.12, imported by
megatron/training) before Megatron is imported. A real checkout's own `megatron/core`
imports triton, which a CPU machine lacks; this one runs there, in the tests and in
`tools/bench_recovery.py --megatron-lm-tree wheel`."""

from __future__ import annotations

import shutil
from pathlib import Path

import megatron

from deadpool_megatron.patching.cli import run

DRIVER = Path(__file__).resolve().parent / "megatron_lm_driver.py"


def wheel_megatron() -> Path:
    """The installed megatron-core's `megatron/` directory."""
    return Path(megatron.__path__[0])


def lay_out_checkout(root: Path, patch: bool = True) -> Path:
    """`root` made a Megatron-LM checkout (`patch`: with deadpool-patch applied, as a user
    applies it); returns it."""
    shutil.copytree(wheel_megatron(), root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # pretrain() runs `make` for the dataset helpers (Megatron-LM's Makefile); the wheel
    # ships them built and no Makefile, so the tree gets an empty one.
    (root / "megatron/core/datasets/Makefile").write_text("default:\n\t@true\n")
    shutil.copy(DRIVER, root / "pretrain_gpt.py")
    if patch:
        code, msg = run([str(root)])
        if code != 0:
            raise RuntimeError(f"deadpool-patch {root} failed: {msg}")
    return root
