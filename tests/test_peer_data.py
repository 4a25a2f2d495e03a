"""What ranks exchange about each other (recovery reports, snapshot sizes, fingerprints, a
buddy's small objects) is parsed as plain data, never unpickled: a corrupt or forged peer
contribution is refused with a clear error and runs no code here."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys

import pytest
import torch

from deadpool_megatron.replay.plan import SPARE_REPORT, RankReport
from deadpool_megatron.snapshot.manifest import pack_objects, unpack_objects
from deadpool_megatron.testing.jobs import REPO


class _RunsCode:
    def __reduce__(self):  # what a forged pickle does on load
        return (os.system, ("echo pwned > /dev/null",))


def test_small_objects_round_trip_as_tensors_and_plain_data() -> None:
    objects = {"iteration": 7, "consumed_samples": 56, "scheduler": {"num_steps": 56,
               "lr_decay_style": "cosine", "max_lr": 1e-3}, "layout": '[["a", 0, 64]]',
               "rng": {"torch": torch.get_rng_state(), "tracker": {"model-parallel-rng":
                                                                   torch.arange(4)}}}
    back = unpack_objects(pack_objects(objects))
    assert back["scheduler"] == objects["scheduler"] and back["layout"] == objects["layout"]
    assert torch.equal(back["rng"]["torch"], objects["rng"]["torch"])


def test_a_forged_small_objects_copy_is_refused_not_run() -> None:
    forged = io.BytesIO()
    torch.save({"iteration": 7, "x": _RunsCode()}, forged)
    with pytest.raises(pickle.UnpicklingError):
        unpack_objects(forged.getvalue())


def test_rank_reports_round_trip_and_malformed_ones_are_named() -> None:
    rep = RankReport(own=(3, 4), ward=(4,), live=4, grads_intact=True, reached=5)
    assert RankReport.from_plain(rep.plain()) == rep
    assert RankReport.from_plain(SPARE_REPORT.plain()) == SPARE_REPORT
    for bad in [None, [], {**rep.plain(), "live": "4"}, {**rep.plain(), "own": [3, "x"]},
                {**rep.plain(), "grads_intact": 1}, {**rep.plain(), "extra": 0}]:
        with pytest.raises(ValueError):
            RankReport.from_plain(bad)


GATHER = r"""
import os, sys, torch, torch.distributed as dist
from deadpool_megatron.integration.plain_gather import BadPeerData, all_gather_plain
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=3)
got = all_gather_plain({"rank": rank, "s": "x" * rank})
assert got == [{"rank": r, "s": "x" * r} for r in range(3)], got
# a peer sending bytes that are not plain data (here: a pickle) is named, not loaded
if rank == 2:
    blob = torch.frombuffer(bytearray(b"\x80\x04K\x01."), dtype=torch.uint8)
    dist.all_gather([torch.zeros(1, dtype=torch.int64) for _ in range(3)],
                    torch.tensor([len(blob)], dtype=torch.int64))
    dist.all_gather([torch.empty(len(blob), dtype=torch.uint8) for _ in range(3)], blob)
    print("ok", flush=True)
else:
    try:
        all_gather_plain(12345)
        print("accepted", flush=True)
    except BadPeerData as err:
        print("ok" if "group rank 2" in str(err) else f"wrong error: {err}", flush=True)
os._exit(0)
"""


def test_all_gather_plain_between_processes(tmp_path) -> None:
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, "-c", GATHER, str(r), str(init)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [o.strip().splitlines()[-1] if o.strip() else o for o in outs] == ["ok"] * 3, outs
