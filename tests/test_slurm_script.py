"""pretrain_scripts/slurm/deadpool_gpt.sbatch run with stand-ins for Slurm's commands: what
each node's launcher would be started with (no job runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "pretrain_scripts" / "slurm" / "deadpool_gpt.sbatch"


def _run(tmp_path: Path, **env: str) -> str:
    """Run the script with `srun` and `scontrol` stand-ins; returns what srun was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node-a\necho node-b\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" >> {tmp_path}/srun.args\n")
    for stub in ("scontrol", "srun"):
        (bin_dir / stub).chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
               "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "7",
               "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2",
               "PYTHON": sys.executable, "RUN_DIR": str(tmp_path / "run"), **env}
    out = subprocess.run(["bash", str(SBATCH)], env=run_env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return (tmp_path / "srun.args").read_text()


def test_the_default_script_is_ours_with_hot_swap_flags(tmp_path: Path) -> None:
    args = _run(tmp_path)
    assert f"{ROOT}/pretrain_scripts/pretrain_gpt.py" in args
    assert "--deadpool " in args and "--spares '1'" in args
    assert "--master-addr 'node-a'" in args
    assert oct((tmp_path / "run" / "job.token").stat().st_mode & 0o777) == "0o600"


def test_a_patched_megatron_lm_tree_runs_its_own_script_with_its_extra_flags(
        tmp_path: Path) -> None:
    upstream = tmp_path / "Megatron-LM" / "pretrain_gpt.py"
    args = _run(tmp_path, SCRIPT=str(upstream),
                EXTRA_ARGS="--tokenizer-type NullTokenizer --vocab-size 32000")
    assert f"'{upstream}'" in args and "pretrain_scripts/pretrain_gpt.py" not in args
    assert "--tokenizer-type NullTokenizer --vocab-size 32000" in args
    assert "--deadpool " in args and "--spares '1'" in args
