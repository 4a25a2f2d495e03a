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
    assert "--deadpool " in args and "SPARES='1'" in args and "--standby-hosts 0" in args
    assert "--master-addr 'node-a'" in args
    assert oct((tmp_path / "run" / "job.token").stat().st_mode & 0o777) == "0o600"


def test_a_patched_megatron_lm_tree_runs_its_own_script_with_its_extra_flags(
        tmp_path: Path) -> None:
    upstream = tmp_path / "Megatron-LM" / "pretrain_gpt.py"
    args = _run(tmp_path, SCRIPT=str(upstream),
                EXTRA_ARGS="--tokenizer-type NullTokenizer --vocab-size 32000")
    assert f"'{upstream}'" in args and "pretrain_scripts/pretrain_gpt.py" not in args
    assert "--tokenizer-type NullTokenizer --vocab-size 32000" in args
    assert "--deadpool " in args and "SPARES='1'" in args


def test_standby_nodes_run_spares_on_every_gpu(tmp_path: Path) -> None:
    """STANDBY_NODES=1 of 3: each node's command run as srun would run it, the launcher
    echoed: nodes 0 and 1 train with one spare, node 2 runs 7 + 1 spares and no rank."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node-a\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\n'
                                  'for n in 0 1 2; do SLURM_NODEID=$n "$@"; done\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\n[ "$1" = -m ] || exec {sys.executable} "$@"\n'
                                    f'echo "$@" >> {tmp_path}/launches\n')
    for stub in ("scontrol", "srun", "python"):
        (bin_dir / stub).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-[a-c]", "SLURM_NNODES": "3",
           "PYTHON": str(bin_dir / "python"), "RUN_DIR": str(tmp_path / "run"),
           "STANDBY_NODES": "1"}
    out = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    launches = (tmp_path / "launches").read_text().splitlines()
    assert len(launches) == 3, launches
    for node, spares in ((0, 1), (1, 1), (2, 8)):
        flags = launches[node].split()
        assert flags[flags.index("--node-rank") + 1] == str(node), launches[node]
        assert flags[flags.index("--spares") + 1] == str(spares), launches[node]
        assert flags[flags.index("--standby-hosts") + 1] == "1", launches[node]
