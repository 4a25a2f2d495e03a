"""deadpool-patch on a Megatron-LM tree laid out from the installed megatron-core wheel
(its megatron/training/ is core_r0.19.0's) plus our upstream-style pretrain_gpt.py driver."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deadpool_megatron.patching.cli import run
from deadpool_megatron.patching.releases import SUPPORTED
from deadpool_megatron.patching.tree import load_patch
from deadpool_megatron.patching.unified_diff import PatchError, apply_file, parse
from deadpool_megatron.testing.checkout import lay_out_checkout, wheel_megatron

PATCHED_FILES = ("megatron/training/arguments.py", "megatron/training/inprocess_restart.py",
                 "megatron/training/training.py")


def _digest(tree: Path) -> dict[str, str]:
    """Every file's hash: 'nothing was written' means this does not change."""
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file()}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return lay_out_checkout(tmp_path / "Megatron-LM", patch=False)


def test_apply_then_reverse_restores_the_tree(tree: Path) -> None:
    before = _digest(tree)
    code, msg = run([str(tree)])
    assert code == 0, msg
    after = _digest(tree)
    changed = sorted(k for k in before if before[k] != after[k])
    assert changed == sorted(PATCHED_FILES)
    assert set(after) == set(before), "no file may be added or left behind (temporaries)"
    text = (tree / "megatron/training/training.py").read_text()
    assert "MegatronLoop.start(" in text and "deadpool.before_optimizer_step()" in text
    code, msg = run([str(tree), "--reverse"])
    assert code == 0, msg
    assert _digest(tree) == before


def test_check_and_status_write_nothing(tree: Path) -> None:
    before = _digest(tree)
    code, msg = run([str(tree), "--check"])
    assert code == 0 and "would apply cleanly" in msg, msg
    code, msg = run([str(tree), "--status"])
    assert code == 0 and msg.count(": unpatched") == len(PATCHED_FILES), msg
    assert _digest(tree) == before


def test_a_dry_run_of_the_reverse_writes_nothing(tree: Path) -> None:
    assert run([str(tree)])[0] == 0
    patched = _digest(tree)
    code, msg = run([str(tree), "--reverse", "--check"])
    assert code == 0 and "would reverse cleanly" in msg, msg
    assert _digest(tree) == patched


def test_applying_twice_is_a_no_op_with_a_message(tree: Path) -> None:
    assert run([str(tree)])[0] == 0
    patched = _digest(tree)
    code, msg = run([str(tree)])
    assert code == 0 and "already patched" in msg and "nothing was written" in msg, msg
    assert _digest(tree) == patched
    code, msg = run([str(tree), "--status"])
    assert msg.count(": patched") == len(PATCHED_FILES), msg


def test_a_mismatched_release_is_refused_naming_the_supported_ones(tree: Path) -> None:
    info = tree / "megatron/core/package_info.py"
    info.write_text(re.sub(r"^MINOR = \d+", "MINOR = 14", info.read_text(), flags=re.M))
    before = _digest(tree)
    code, msg = run([str(tree)])
    assert code == 1
    assert "0.14." in msg and all(r.branch in msg for r in SUPPORTED), msg
    assert _digest(tree) == before


def test_not_a_megatron_tree_is_refused(tmp_path: Path) -> None:
    code, msg = run([str(tmp_path)])
    assert code == 1 and "package_info.py is missing" in msg, msg


def test_a_modified_file_refuses_every_file_and_writes_nothing(tree: Path) -> None:
    """training.py edited where a hunk lands: arguments.py, which would apply, stays too."""
    target = tree / "megatron/training/training.py"
    target.write_text(target.read_text().replace(
        "        args.consumed_train_samples += iteration_sequences\n",
        "        args.consumed_train_samples += iteration_sequences  # local edit\n"))
    before = _digest(tree)
    code, msg = run([str(tree)])
    assert code == 1 and "megatron/training/training.py" in msg and "Nothing was written" in msg
    assert _digest(tree) == before


def test_a_partly_patched_tree_is_refused(tree: Path) -> None:
    assert run([str(tree)])[0] == 0
    shutil.copy(wheel_megatron() / "training/arguments.py", tree / "megatron/training/arguments.py")
    before = _digest(tree)
    for argv in ([str(tree)], [str(tree), "--reverse"]):
        code, msg = run(argv)
        assert code == 1 and "partly patched" in msg, msg
    assert _digest(tree) == before


def test_hunks_apply_at_an_offset_but_never_to_other_text() -> None:
    fp = parse("--- a/f\n+++ b/f\n@@ -2,2 +2,3 @@\n b\n+new\n c\n")[0]
    assert apply_file("a\nb\nc\n", fp) == "a\nb\nnew\nc\n"
    assert apply_file("x\ny\na\nb\nc\n", fp) == "x\ny\na\nb\nnew\nc\n"
    with pytest.raises(PatchError, match="hunk 1"):
        apply_file("a\nb\nd\n", fp)


def test_the_patch_stays_small_and_calls_only_the_package() -> None:
    """The logic belongs in deadpool_megatron: every file gains a few lines at most."""
    for release in SUPPORTED:
        for fp in load_patch(release.patch_file):
            added = [t for h in fp.hunks for tag, t in h.lines if tag == "+"]
            removed = {t.split("(")[0] for h in fp.hunks for tag, t in h.lines if tag == "-"}
            assert len(added) <= 30, (fp.path, len(added))
            new_blocks = [t for t in added if t.split("(")[0] not in removed
                          and t.lstrip().startswith(("class ", "def ", "for ", "while "))]
            assert not new_blocks, (fp.path, new_blocks)


def test_the_command_line_entry_points(tree: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "tools" / "apply_patches.py"
    out = subprocess.run([sys.executable, str(script), str(tree), "--status"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "unpatched" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, str(script), str(tree / "megatron")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not a Megatron-LM tree" in out.stderr
    assert "Megatron-LM" not in out.stdout


_PARSE = """
import json, sys
sys.path.insert(0, sys.argv.pop(1))
from deadpool_megatron.rehearsal import prepare_megatron_import
from deadpool_megatron.rehearsal.imports import provide_typing_override
prepare_megatron_import(True)
provide_typing_override()
import megatron.training
from megatron.training.arguments import parse_and_validate_args
args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
print(json.dumps({"megatron": megatron.training.__file__,
                  "flags": {k: v for k, v in vars(args).items() if k.startswith("deadpool")}}))
"""

_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
          "--vocab-size", "512", "--distributed-backend", "gloo"]


def _parse(tree: Path, flags: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    return subprocess.run([sys.executable, "-c", _PARSE, str(tree), *_MODEL, *flags],
                          capture_output=True, text=True, timeout=180, cwd=tree, env=env)


def test_the_patched_trees_own_parser_takes_the_deadpool_flags(tree: Path) -> None:
    flags = ["--deadpool", "--deadpool-snapshot-interval", "2",
             "--deadpool-inject", "kill rank=0 iter=2"]
    bare = _parse(tree, flags)
    assert bare.returncode != 0 and "unrecognized arguments: --deadpool" in bare.stderr
    assert run([str(tree)])[0] == 0
    out = _parse(tree, flags)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed["megatron"].startswith(str(tree)), "the tree's megatron, not the wheel's"
    assert parsed["flags"]["deadpool"] is True
    assert parsed["flags"]["deadpool_snapshot_interval"] == 2
    assert parsed["flags"]["deadpool_inject"] == ["kill rank=0 iter=2"]
