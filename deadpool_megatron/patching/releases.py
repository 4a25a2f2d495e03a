"""Which Megatron-LM releases patches/ supports, and which release a tree is."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE_INFO = "megatron/core/package_info.py"


@dataclass(frozen=True)
class Release:
    branch: str  # Megatron-LM's release branch the diff was made against
    version_prefix: str  # package_info versions it covers (a branch's patch releases)
    patch_file: str  # under patches/

    def covers(self, version: str) -> bool:
        return version == self.version_prefix or version.startswith(self.version_prefix + ".")


# The megatron-core 0.19.x wheels ship the same megatron/training/ as core_r0.19.0.
SUPPORTED: tuple[Release, ...] = (
    Release(branch="core_r0.19.0", version_prefix="0.19", patch_file="core_r0.19.0.patch"),
)


class UnsupportedTree(RuntimeError):
    """The directory is not a Megatron-LM tree of a supported release."""


def supported_names() -> str:
    return ", ".join(f"{r.branch} (megatron-core {r.version_prefix}.x)" for r in SUPPORTED)


def tree_version(tree: Path) -> str:
    """The release in the tree's megatron/core/package_info.py, e.g. '0.19.1'."""
    info = tree / PACKAGE_INFO
    if not info.is_file():
        raise UnsupportedTree(
            f"{tree} is not a Megatron-LM tree: {PACKAGE_INFO} is missing. Pass the directory "
            f"that holds megatron/ (a Megatron-LM checkout); supported: {supported_names()}.")
    text = info.read_text()
    parts = {}
    for name in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{name}\s*=\s*(\d+)", text, re.MULTILINE)
        if m is None:
            raise UnsupportedTree(f"{info}: no '{name} = <number>' line; cannot tell the "
                                  f"release. Supported: {supported_names()}.")
        parts[name] = m.group(1)
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def release_of(tree: Path) -> tuple[str, Release]:
    """The tree's version and the supported release covering it."""
    version = tree_version(tree)
    for release in SUPPORTED:
        if release.covers(version):
            return version, release
    raise UnsupportedTree(
        f"{tree} is Megatron-LM {version} ({PACKAGE_INFO}); deadpool-patch supports "
        f"{supported_names()}. Check out a supported release branch, or port the patch "
        f"(patches/README.md, 'Upgrading to a new release').")
