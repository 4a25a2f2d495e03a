"""Entry point of pretrain_scripts/pretrain_gpt.py: Megatron-LM's own pretrain() for GPT, in
the megatron-core wheel's megatron/ patched with the same hook points deadpool-patch adds to
a user's checkout, every Megatron-LM flag plus the --deadpool group.

On a machine without CUDA, what Megatron's parser would otherwise demand of a CPU run is a
default, said once: Megatron's own CPU switches (no TransformerEngine, apex or fused
kernels), the gloo backend; on a GPU without TransformerEngine, the layers and kernels that
need neither it nor apex; on any machine, for the NullTokenizer (the default tokenizer) a
vocabulary, and an evaluation interval (without one Megatron fails while it sizes the
validation set; no validation unless --eval-iters asks for it).
A command line that gives any of them keeps its own value.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Sequence

# (flag, value or None for a switch), each given unless the command line gives the flag.
# Without TransformerEngine (a CPU, or a GPU without the extra): the layers and kernels that
# do not need it or apex.
WITHOUT_TE_DEFAULTS: tuple[tuple[str, str | None], ...] = (
    ("--transformer-impl", "local"), ("--no-gradient-accumulation-fusion", None),
    ("--no-persist-layer-norm", None), ("--no-masked-softmax-fusion", None),
    ("--no-rope-fusion", None))
# On a machine without CUDA, also: no fused bias kernels, no rerun state machine, gloo, and
# no data-loader worker processes (they would compete with the ranks for the same cores, two
# per rank by default; a spare forking them took 0.15 s of its build; the batches are the
# same either way).
CPU_DEFAULTS: tuple[tuple[str, str | None], ...] = WITHOUT_TE_DEFAULTS + (
    ("--no-bias-gelu-fusion", None), ("--no-bias-dropout-fusion", None),
    ("--rerun-mode", "disabled"), ("--distributed-backend", "gloo"), ("--num-workers", "0"))
CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
NULL_TOKENIZER_VOCAB = "512"  # the vocabulary of a --mock-data run without a tokenizer
EVAL_INTERVAL = "1000"  # Megatron-LM's example scripts' value


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def defaults_for(argv: Sequence[str], cuda: bool,
                 transformer_engine: bool = True) -> list[str]:
    """The flags to add to `argv` (pure, so tested without Megatron)."""
    added: list[str] = []
    defaults = CPU_DEFAULTS if not cuda else () if transformer_engine else WITHOUT_TE_DEFAULTS
    for flag, value in defaults:
        if not _given(argv, flag):
            added += [flag] if value is None else [flag, value]
    if not _given(argv, "--eval-interval"):  # Megatron divides by it (None: a TypeError)
        added += ["--eval-interval", EVAL_INTERVAL]
        if not _given(argv, "--eval-iters"):  # no validation unless asked for
            added += ["--eval-iters", "0"]
    tokenizer = _value(argv, "--tokenizer-type") or "NullTokenizer"
    if tokenizer == "NullTokenizer" and not _given(argv, "--vocab-size"):
        added += ["--vocab-size", NULL_TOKENIZER_VOCAB]
    return added


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from deadpool_megatron.patching.wheel_tree import WheelTreeError, use_patched_tree

    argv = list(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    added = defaults_for(argv, cuda,
                         importlib.util.find_spec("transformer_engine") is not None)
    said = added[:]
    if not cuda and CONNECTIONS not in os.environ:  # Megatron asks it of TP/CP runs
        os.environ[CONNECTIONS] = "1"
        said.append(f"{CONNECTIONS}=1")
    if said and os.environ.get("RANK", "0") == "0" and "--help" not in argv:
        print(f"pretrain_gpt.py: {'' if cuda else 'no CUDA: '}added the defaults "
              f"{' '.join(said)}", flush=True)
    try:
        use_patched_tree()
    except WheelTreeError as err:
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        return 2
    from deadpool_megatron.integration.megatron_gpt import print_help, run

    if "-h" in argv or "--help" in argv:
        print_help("pretrain_gpt.py")
        return 0
    sys.argv = [sys.argv[0], *argv, *added]
    run()
    return 0


def preload() -> None:
    """What deadpool-launch's preloader imports for this script's workers on a machine
    without CUDA (launch/preload.py; the script names this function): main()'s imports, the
    patched tree's megatron first."""
    from deadpool_megatron.patching.wheel_tree import use_patched_tree
    from deadpool_megatron.rehearsal import prepare_megatron_import
    from deadpool_megatron.rehearsal.imports import provide_typing_override

    prepare_megatron_import(True)  # as integration/megatron_gpt.py's cpu_rehearsal() does
    provide_typing_override()
    use_patched_tree()
    import megatron.core  # noqa: F401
    import megatron.training  # noqa: F401
