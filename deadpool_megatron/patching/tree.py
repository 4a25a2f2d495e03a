"""A Megatron-LM tree's state against one patch set, and writing it all or nothing."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deadpool_megatron.patching.unified_diff import FilePatch, PatchError, apply_file, parse

UNPATCHED, PATCHED, CONFLICT = "unpatched", "patched", "conflict"


@dataclass
class FileState:
    path: str
    state: str  # UNPATCHED | PATCHED | CONFLICT
    original: str | None  # the file's text now (None: missing)
    patched: str | None  # its text once patched (state UNPATCHED)
    unpatched: str | None  # its text once reversed (state PATCHED)
    detail: str = ""  # why CONFLICT


def patches_dir() -> Path:
    """patches/ of this source checkout (deadpool-patch runs from an editable install)."""
    here = Path(__file__).resolve().parents[2] / "patches"
    if not here.is_dir():
        raise FileNotFoundError(f"{here} not found: install DeadPool-Megatron from its source "
                                f"checkout (pip install -e .) so patches/ is next to it.")
    return here


def load_patch(patch_file: str) -> list[FilePatch]:
    return parse((patches_dir() / patch_file).read_text())


def _try(text: str, patch: FilePatch) -> tuple[str | None, str]:
    try:
        return apply_file(text, patch), ""
    except PatchError as err:
        return None, str(err)


def inspect(tree: Path, patches: list[FilePatch]) -> list[FileState]:
    """Each patched file's state; nothing is written."""
    states = []
    for fp in patches:
        target = tree / fp.path
        if not target.is_file():
            states.append(FileState(fp.path, CONFLICT, None, None, None, "file is missing"))
            continue
        text = target.read_text()
        forward, why_not = _try(text, fp)
        backward, _ = _try(text, fp.reversed())
        if forward is not None and backward is None:
            states.append(FileState(fp.path, UNPATCHED, text, forward, None))
        elif backward is not None and forward is None:
            states.append(FileState(fp.path, PATCHED, text, None, backward))
        else:
            detail = ("matches both the patched and the unpatched form" if forward is not None
                      else f"neither the release's text nor the patched text: {why_not}")
            states.append(FileState(fp.path, CONFLICT, text, None, None, detail))
    return states


def write_all(tree: Path, texts: dict[str, str], originals: dict[str, str]) -> None:
    """Replace every file with its new text, or none: all new texts are written to temporary
    files first; if a rename fails, the files already replaced get their old text back."""
    staged: dict[str, str] = {}
    try:
        for rel, text in texts.items():
            target = tree / rel
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, target.stat().st_mode & 0o7777)
            staged[rel] = tmp
        done: list[str] = []
        try:
            for rel, tmp in staged.items():
                os.replace(tmp, tree / rel)
                done.append(rel)
        except OSError:
            for rel in done:
                (tree / rel).write_text(originals[rel])
            raise
    finally:
        for tmp in staged.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
