"""Parse and apply unified diffs (the subset `diff -u` and `git diff` write), in memory.

Our own applier, not `patch`: it works on text and never touches a file, so the caller can
check every hunk of every file before writing anything, and a test can drive it directly.
A hunk applies where its old lines (context and removals) match exactly: at its stated line
or, nearest first, at an offset (lines added above it by the user); there is no fuzz.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A diff that cannot be read, or a hunk that does not match the file."""


@dataclass(frozen=True)
class Hunk:
    old_start: int  # 1-based, as in the header
    lines: tuple[tuple[str, str], ...]  # (' ' | '-' | '+', text without its newline)

    @property
    def old(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "+"]

    @property
    def new(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "-"]

    def reversed(self) -> "Hunk":
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(self.old_start, tuple((swap[t], s) for t, s in self.lines))


@dataclass
class FilePatch:
    path: str  # relative to the tree's root, the `a/` or `b/` prefix dropped
    hunks: list[Hunk] = field(default_factory=list)

    def reversed(self) -> "FilePatch":
        return FilePatch(self.path, [h.reversed() for h in self.hunks])


def _strip_prefix(name: str) -> str:
    name = name.split("\t", 1)[0].strip()
    return name[2:] if name[:2] in ("a/", "b/") else name


def parse(text: str) -> list[FilePatch]:
    """The file patches of a unified diff; lines outside them (comments) are ignored."""
    files: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_strip_prefix(lines[i + 1][4:])))
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise PatchError(f"line {i + 1}: hunk before any '---'/'+++' file header")
            hunk, i = _read_hunk(lines, i, m)
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise PatchError("no file patches found (expected '--- a/...' / '+++ b/...' headers)")
    return files


def _read_hunk(lines: list[str], i: int, m: re.Match) -> tuple[Hunk, int]:
    old_left = int(m.group(2) or 1)
    new_left = int(m.group(4) or 1)
    body: list[tuple[str, str]] = []
    j = i + 1
    while old_left > 0 or new_left > 0:
        if j >= len(lines):
            raise PatchError(f"line {i + 1}: hunk ends early (the header's counts are wrong)")
        raw = lines[j]
        tag, text = (raw[:1] or " "), raw[1:]
        if tag == "\\":  # "\ No newline at end of file": our targets all end with one
            j += 1
            continue
        if tag not in " -+":
            raise PatchError(f"line {j + 1}: expected ' ', '-' or '+', got {raw[:20]!r}")
        body.append((tag, text))
        old_left -= tag in " -"
        new_left -= tag in " +"
        j += 1
    return Hunk(int(m.group(1)), tuple(body)), j


def _find(lines: list[str], block: list[str], expected: int, lo: int) -> int | None:
    """Index where `block` matches `lines`, at or after `lo`, nearest to `expected`."""
    last = len(lines) - len(block)
    candidates = sorted(range(lo, last + 1), key=lambda k: (abs(k - expected), k))
    for k in candidates:
        if lines[k:k + len(block)] == block:
            return k
    return None


def apply_file(text: str, patch: FilePatch) -> str:
    """`text` with every hunk of `patch` applied; PatchError names the first that fails."""
    lines = text.splitlines()
    out: list[str] = []
    pos = 0  # lines[:pos] are consumed
    shift = 0  # how far the file's lines sit from the hunks' stated ones
    for n, hunk in enumerate(patch.hunks, 1):
        expected = max(hunk.old_start - 1 + shift, pos)
        at = _find(lines, hunk.old, expected, pos)
        if at is None:
            raise PatchError(f"{patch.path}: hunk {n} (line {hunk.old_start}) does not match")
        shift = at - (hunk.old_start - 1)
        out.extend(lines[pos:at])
        out.extend(hunk.new)
        pos = at + len(hunk.old)
    out.extend(lines[pos:])
    return "\n".join(out) + ("\n" if text.endswith("\n") or not text else "")
