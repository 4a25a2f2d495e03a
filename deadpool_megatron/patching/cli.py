"""deadpool-patch MEGATRON_LM_DIR [--check] [--reverse] | --status

Applies (or reverses) the patch set of the tree's release. Every file is checked before any
is written; on any error nothing is written and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from deadpool_megatron.patching.releases import UnsupportedTree, release_of
from deadpool_megatron.patching.tree import (CONFLICT, PATCHED, UNPATCHED, FileState, inspect,
                                             load_patch, write_all)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deadpool-patch",
        description="Patch a Megatron-LM tree so its own training loop calls DeadPool-Megatron.")
    p.add_argument("tree", metavar="MEGATRON_LM_DIR", type=Path,
                   help="The Megatron-LM checkout (the directory that holds megatron/).")
    p.add_argument("--check", action="store_true",
                   help="Dry run (with --reverse too): say what would change, write nothing.")
    p.add_argument("--reverse", action="store_true", help="Remove the patches.")
    p.add_argument("--status", action="store_true",
                   help="Print the release and each file's state; write nothing.")
    return p


def _refuse(states: list[FileState]) -> str | None:
    bad = [s for s in states if s.state == CONFLICT]
    if bad:
        lines = "\n".join(f"  {s.path}: {s.detail}" for s in bad)
        return ("cannot patch: these files differ from the release the patch was made for\n"
                f"{lines}\nRestore them (git checkout -- FILE), or port the hunks by hand.")
    kinds = {s.state for s in states}
    if kinds == {UNPATCHED, PATCHED}:
        lines = "\n".join(f"  {s.path}: {s.state}" for s in states)
        return (f"the tree is partly patched:\n{lines}\nRestore the patched files from the "
                "release (git checkout -- FILE) and apply again.")
    return None


def run(argv: Sequence[str] | None = None) -> tuple[int, str]:
    """(exit status, message): the whole command, without printing (tests call this)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.status and (args.check or args.reverse):
        parser.error("--status reports only; use it without --check or --reverse")
    tree: Path = args.tree.resolve()
    try:
        version, release = release_of(tree)
    except UnsupportedTree as err:
        return 1, f"deadpool-patch: {err}"
    states = inspect(tree, load_patch(release.patch_file))
    head = f"Megatron-LM {version} at {tree}: patch set {release.branch}"
    if args.status:
        body = "\n".join(f"  {s.path}: {s.state}" + (f" ({s.detail})" if s.detail else "")
                         for s in states)
        return (1 if any(s.state == CONFLICT for s in states) else 0), f"{head}\n{body}"
    refusal = _refuse(states)
    if refusal is not None:
        return 1, f"deadpool-patch: {refusal}\nNothing was written."
    want = UNPATCHED if args.reverse else PATCHED
    if all(s.state == want for s in states):
        what = "not patched: nothing to reverse" if args.reverse else "already patched"
        return 0, f"{head}\n{what}; nothing was written."
    texts = {s.path: (s.unpatched if args.reverse else s.patched) for s in states}
    verb = "reverse" if args.reverse else "apply"
    files = "\n".join(f"  {p}" for p in texts)
    if args.check:
        return 0, f"{head}\nwould {verb} cleanly to:\n{files}\n(--check: nothing was written)"
    try:
        write_all(tree, texts, {s.path: s.original for s in states})  # type: ignore[misc]
    except OSError as err:
        return 1, f"deadpool-patch: writing failed ({err}); every file keeps its old text."
    done = "reversed" if args.reverse else "applied"
    return 0, f"{head}\n{done}:\n{files}"


def main(argv: Sequence[str] | None = None) -> int:
    code, message = run(argv)
    print(message, file=sys.stderr if code else sys.stdout)
    return code
