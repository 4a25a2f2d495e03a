"""pretrain_scripts/pretrain_gpt.py is Megatron-LM's pretrain(): Megatron's flags and the
--deadpool group, in the wheel's megatron/ laid out as a patched tree, with what a CPU run
needs as defaults (jobs in Megatron's loop: tests/test_megatron_lm_run.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deadpool_megatron.patching import wheel_tree
from deadpool_megatron.patching.releases import release_of
from deadpool_megatron.patching.tree import PATCHED, inspect, load_patch
from deadpool_megatron.testing.jobs import GPT_3D_ARGS, MEGATRON_GPT, REPO
from deadpool_megatron.training.megatron_main import CPU_DEFAULTS, defaults_for


def test_on_cpu_megatrons_cpu_switches_are_defaults_and_given_ones_stay() -> None:
    added = defaults_for(GPT_3D_ARGS, cuda=False)
    for flag, value in CPU_DEFAULTS:
        if flag == "--distributed-backend":
            assert flag not in added  # GPT_3D_ARGS gives gloo
        else:
            assert flag in added and (value is None or added[added.index(flag) + 1] == value)
    assert added[-2:] == ["--vocab-size", "512"]  # the NullTokenizer needs a vocabulary
    assert "--eval-interval" in added and "--eval-iters" in added
    given = ["--transformer-impl", "transformer_engine", "--rerun-mode=validate_results",
             "--eval-interval", "5", "--vocab-size", "1024"]
    added = defaults_for(given, cuda=False)
    assert not {"--transformer-impl", "--rerun-mode", "--eval-interval", "--eval-iters",
                "--vocab-size"} & set(added), added
    assert "--distributed-backend" in added


def test_on_a_gpu_only_what_megatron_would_fail_without() -> None:
    assert defaults_for(["--tokenizer-type", "GPT2BPETokenizer", "--eval-interval", "10"],
                        cuda=True) == []
    assert defaults_for(["--eval-iters", "3"], cuda=True) == [
        "--eval-interval", "1000", "--vocab-size", "512"]
    # Without TransformerEngine, Megatron's default layers and fused kernels cannot be built.
    added = defaults_for(["--eval-interval", "10"], cuda=True, transformer_engine=False)
    assert added[:2] == ["--transformer-impl", "local"] and "--no-rope-fusion" in added
    assert "--distributed-backend" not in added and "--num-workers" not in added
    assert "--transformer-impl" not in defaults_for(
        ["--transformer-impl", "transformer_engine"], cuda=True, transformer_engine=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One tree cache for the module's tests (laying the wheel out copies 21 MB)."""
    return tmp_path_factory.mktemp("tree_cache")


def test_the_wheel_is_laid_out_as_a_patched_tree_once(cache: Path) -> None:
    tmp_path = cache
    tree = wheel_tree.patched_tree(tmp_path)
    _, release = release_of(tree)
    states = inspect(tree, load_patch(release.patch_file))
    assert states and all(s.state == PATCHED for s in states), [(s.path, s.state) for s in states]
    marker = tree / "megatron" / "training" / "training.py"
    stamp = marker.stat().st_mtime_ns
    assert wheel_tree.patched_tree(tmp_path) == tree and marker.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [tree.name]


def test_help_lists_megatrons_flags_and_the_deadpool_group(cache: Path) -> None:
    proc = subprocess.run([sys.executable, str(MEGATRON_GPT), "--help"], capture_output=True,
                          text=True, timeout=300, cwd=REPO,
                          env={**_env(), wheel_tree.ENV: str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags = {line.split()[0].rstrip(",") for line in proc.stdout.splitlines()
             if line.startswith("  --")}
    for flag in ("--tensor-model-parallel-size", "--sequence-parallel", "--num-experts",
                 "--overlap-grad-reduce", "--recompute-granularity", "--data-path",
                 "--tokenizer-type", "--eval-interval", "--deadpool", "--deadpool-inject"):
        assert flag in flags, flag
    assert len(flags) > 700, len(flags)  # Megatron-LM's, not the reduced loop's 54


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}


def test_megatron_imported_first_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    import megatron

    monkeypatch.setitem(sys.modules, "megatron", megatron)
    with pytest.raises(wheel_tree.WheelTreeError, match="call use_patched_tree"):
        wheel_tree.use_patched_tree()
