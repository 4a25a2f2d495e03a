"""The megatron-core wheel's `megatron/` package (megatron/training included) as a patched
Megatron-LM tree, made once per wheel and patch set in a cache directory, so that
pretrain_scripts/pretrain_gpt.py runs Megatron's own pretrain() through the same hook points
that deadpool-patch adds to a user's checkout (one set of hook points, no copied code).

The tree is made aside and renamed into place (a reader never sees half a tree); workers of
one job starting together take a lock, and one of them makes it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from deadpool_megatron.patching.releases import release_of
from deadpool_megatron.patching.tree import CONFLICT, PATCHED, inspect, load_patch, patches_dir

ENV = "DEADPOOL_MEGATRON_TREE_CACHE"  # where the patched trees are kept
LOCK_TIMEOUT_S = 300.0


class WheelTreeError(RuntimeError):
    """The wheel's megatron package cannot be laid out as a patched tree; says why."""


def installed_megatron(trees: Path | None = None) -> Path:
    """The directory of the installed megatron package (found without importing it; not a
    patched tree under `trees`, where megatron may come from once imported)."""
    spec = importlib.util.find_spec("megatron")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if trees is not None and Path(location).resolve().is_relative_to(trees.resolve()):
            continue
        if (Path(location) / "training" / "training.py").is_file():
            return Path(location)
    raise WheelTreeError("no megatron package with megatron/training found: install "
                         "megatron-core (pip install -r requirements.txt)")


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deadpool-megatron"
    return Path(os.environ.get(ENV, default))


def tree_name(package: Path) -> str:
    """One name per wheel (its version and where it is installed) and patch set."""
    version, release = release_of(package.parent)
    digest = hashlib.sha256()
    digest.update(str(package.resolve()).encode())
    digest.update((patches_dir() / release.patch_file).read_bytes())
    return f"megatron-lm-{version}-{digest.hexdigest()[:12]}"


def patched_tree(root: Path | None = None) -> Path:
    """The patched tree (the directory holding megatron/), made if it is not there yet."""
    root = root or cache_root()
    package = installed_megatron(root)
    tree = root / tree_name(package)
    if (tree / "megatron").is_dir():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        if not (tree / "megatron").is_dir():
            _make(package, tree)
    return tree


def _make(package: Path, tree: Path) -> None:
    aside = Path(tempfile.mkdtemp(prefix=f".{tree.name}.", dir=tree.parent))
    try:
        shutil.copytree(package, aside / "megatron",
                        ignore=shutil.ignore_patterns("__pycache__"))
        # pretrain() runs `make` for the dataset helpers (Megatron-LM's Makefile); the wheel
        # ships them built and no Makefile.
        (aside / "megatron/core/datasets/Makefile").write_text("default:\n\t@true\n")
        _, release = release_of(aside)
        states = inspect(aside, load_patch(release.patch_file))
        bad = [f"{s.path}: {s.detail}" for s in states if s.state == CONFLICT]
        if bad:
            raise WheelTreeError(f"the installed megatron package ({package}) does not match "
                                 f"patch set {release.branch}: " + "; ".join(bad))
        for s in states:
            if s.state != PATCHED:
                (aside / s.path).write_text(s.patched or "")
        os.rename(aside, tree)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


class _locked:
    """An exclusive lock on `path`, waited for LOCK_TIMEOUT_S at most."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise WheelTreeError(f"{self.path} held for {LOCK_TIMEOUT_S:.0f} s: another "
                                         f"process is making the patched tree, or left it "
                                         f"locked; remove {self.path.parent} and retry")
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def use_patched_tree(root: Path | None = None) -> Path:
    """Put the patched tree first on sys.path; before anything imported megatron, or after
    this very call imported it from the tree (the preloader's, launch/preload.py)."""
    if "megatron" in sys.modules:
        loaded = list(getattr(sys.modules["megatron"], "__path__", []))
        tree = patched_tree(root)
        if str(tree) in sys.path and loaded and Path(loaded[0]) == tree / "megatron":
            return tree
        raise WheelTreeError(f"megatron was imported before the patched tree was put in "
                             f"place (from {loaded}): call use_patched_tree() first")
    tree = patched_tree(root)
    sys.path.insert(0, str(tree))
    return tree
