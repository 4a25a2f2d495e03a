"""No redundant bytes, without processes: the shard's two regions, the partial buddy copy
and its CRC table, the replicated region's check, and the plan's choice of target."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deadpool_megatron.control.policy import RecoveryImpossible
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.config import parse_configs
from deadpool_megatron.replay.plan import SPARE_REPORT, RankReport, plan_recovery
from deadpool_megatron.snapshot.buffers import (DoubleBuffer, Slot, checksum, chunk_table,
                                                unique_checksum)
from deadpool_megatron.snapshot.manifest import build_manifest
from deadpool_megatron.snapshot.transport import ReplicaMismatch, take_region
from deadpool_megatron.topology import ParallelSizes, buddy_map, coord_of
from deadpool_megatron.topology.replicas import replica_holders


def _model_and_optimizer() -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, type("O", (), {"optimizer": opt})()


@pytest.mark.parametrize("distributed", [False, True])
def test_replicated_region_first_and_decided_by_what_is_known(distributed: bool) -> None:
    model, holder = _model_and_optimizer()
    m = build_manifest([model], holder, distributed_optimizer=distributed)
    split = m.replicated_nbytes
    rep = [e for e in m.entries if e.dp_replicated]
    uniq = [e for e in m.entries if not e.dp_replicated]
    assert rep and uniq and all(e.offset + e.nbytes <= split for e in rep)
    assert all(e.offset >= split for e in uniq)
    # Parameters always replicated; module buffers (BatchNorm's running stats) never;
    # optimizer state replicated only without the distributed optimizer.
    assert all(e.dp_replicated for e in m.entries if e.name.startswith("model0.")
               and ".buffer." not in e.name)
    assert all(not e.dp_replicated for e in m.entries if ".buffer." in e.name)
    opt = [e for e in m.entries if not e.name.startswith("model")]
    assert opt and all(e.dp_replicated == (not distributed) for e in opt)
    assert m.dp_replicated_bytes <= split < m.nbytes


def _sealed(manifest_flat: torch.Tensor, split: int, chunk: int, objects: bytes) -> Slot:
    slot = Slot(manifest_flat.clone())
    slot.seal(3, objects, checksum(slot.flat, objects))
    table = chunk_table(slot.flat, split, chunk)
    slot.seal_regions(split, table, unique_checksum(slot.flat, split, table, objects))
    return slot


def _partial_copy(slot: Slot) -> Slot:
    """What the buddy holds: unique region, objects, table; the replicated bytes absent."""
    copy = Slot(torch.zeros_like(slot.flat))
    copy.flat[slot.split:] = slot.flat[slot.split:]
    copy.seal(slot.iteration, slot.objects, slot.unique_crc)
    copy.seal_regions(slot.split, slot.table, slot.unique_crc, partial=True)
    return copy


def test_partial_copy_verifies_and_is_completed_bit_exact_from_the_peer() -> None:
    flat = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    own = _sealed(flat, split=700, chunk=128, objects=b"rng")
    assert len(own.table) == 6  # 5 whole chunks of 128 and one of 60
    copy = _partial_copy(own)
    assert copy.verify() and copy.partial
    copy.flat[800] ^= 1  # the unique region is covered by the buddy copy's checksum
    assert not copy.verify()
    copy.flat[800] ^= 1
    peer = own.flat.clone()  # a data-parallel peer's own slot: the same replicated bytes
    take_region(copy, lambda piece: piece.copy_(
        peer[piece.data_ptr() - copy.flat.data_ptr():][:piece.numel()]), "peer", 128)
    assert not copy.partial and copy.check() and copy.iteration == 3
    assert torch.equal(copy.flat, own.flat) and copy.crc == own.crc and copy.verify()


def test_a_corrupted_replicated_chunk_from_the_peer_is_refused() -> None:
    own = _sealed(torch.randint(0, 255, (1000,), dtype=torch.uint8), 700, 128, b"o")
    copy = _partial_copy(own)
    peer = own.flat.clone()
    peer[300] ^= 0x10  # chunk 2 of the peer's bytes differs from the failed rank's
    received = []

    def receive(piece: torch.Tensor) -> None:
        received.append(piece.numel())
        piece.copy_(peer[piece.data_ptr() - copy.flat.data_ptr():][:piece.numel()])

    with pytest.raises(ReplicaMismatch, match="chunk 2: CRC32C"):
        take_region(copy, receive, "data-parallel peer 7", 128)
    assert sum(received) == 700  # every chunk drained: the sender is never left waiting
    assert copy.iteration == -1 and not copy.check()  # never accepted
    assert isinstance(ReplicaMismatch("x"), RecoveryImpossible)


def test_partial_slots_are_listed_apart() -> None:
    buf = DoubleBuffer.allocate(1000)
    own = _sealed(torch.randint(0, 255, (1000,), dtype=torch.uint8), 700, 128, b"o")
    slot = buf.begin_write()
    slot.flat.copy_(_partial_copy(own).flat)
    slot.seal(3, b"o", own.unique_crc)
    slot.seal_regions(700, own.table, own.unique_crc, partial=True)
    assert buf.available() == [3] and buf.partial() == [3]
    again = buf.begin_write()  # a fresh write forgets the old region layout
    assert not again.partial and again.table == ()


def test_a_whole_copy_beside_a_partial_one_of_the_same_iteration_is_the_one_held() -> None:
    """A spare's restore broke before its region came (its source died), the next one
    received the iteration again and completed it: the partial slot is still there."""
    buf = DoubleBuffer.allocate(1000, count=3)
    own = _sealed(torch.randint(0, 255, (1000,), dtype=torch.uint8), 700, 128, b"o")
    stale = buf.begin_write()
    stale.flat.copy_(_partial_copy(own).flat)
    stale.seal(3, b"o", own.unique_crc)
    stale.seal_regions(700, own.table, own.unique_crc, partial=True)
    whole = buf.begin_write()
    assert whole is not stale
    whole.flat.copy_(own.flat)
    whole.seal(3, b"o", own.crc)
    whole.seal_regions(700, own.table, own.unique_crc)
    assert buf.find(3) is whole and buf.available() == [3] and buf.partial() == []


def test_the_flag_turns_the_skip_off() -> None:
    (on,) = parse_configs([DeadPoolConfig], ["--deadpool"], prog="x")
    (off,) = parse_configs([DeadPoolConfig], ["--deadpool", "--deadpool-send-replicated"],
                           prog="x")
    assert not on.deadpool_send_replicated and off.deadpool_send_replicated


# -- the plan ------------------------------------------------------------------------------
SIZES = ParallelSizes(tp=2, pp=2, dp=2)
RPN = 1  # one rank per node: every rank's data-parallel peer is on another node
REPLICA = [coord_of(r, SIZES).dp for r in range(8)]
BUDDY = buddy_map(8, RPN)
HOLDERS = replica_holders(SIZES, RPN)


def _reports(own: tuple = (4, 3), partial: bool = True) -> list[RankReport]:
    return [RankReport(own=own, ward=(4, 3), live=4, grads_intact=False, reached=5,
                       ward_partial=(4, 3) if partial else ()) for _ in range(8)]


def test_plan_takes_the_replicated_region_from_the_source() -> None:
    assert BUDDY[5] == 6 and HOLDERS[5] == (7,)
    reports = _reports()
    reports[5] = SPARE_REPORT
    plan = plan_recovery(reports, {5}, BUDDY, REPLICA, 4, holders=HOLDERS)
    assert plan.target == 4 and plan.restore[5] == "buddy"
    assert plan.replica_from == (None,) * 5 + (7,) + (None,) * 2
    whole = _reports(partial=False)
    whole[5] = SPARE_REPORT  # whole copies at the buddy: nothing taken from a peer
    assert plan_recovery(whole, {5}, BUDDY, REPLICA, 4, holders=HOLDERS).replica_from == \
        (None,) * 8


def test_plan_picks_a_snapshot_the_source_still_holds_in_its_own_slots() -> None:
    reports = _reports()
    reports[5] = SPARE_REPORT
    # The source's own slots no longer hold 4 (its live state is 4: that does not count).
    reports[7] = dataclasses.replace(reports[7], own=(3, 2))
    plan = plan_recovery(reports, {5}, BUDDY, REPLICA, 4, holders=HOLDERS)
    assert plan.target == 3 and plan.replica_from[5] == 7


def test_source_dead_too_is_refused_with_a_clear_message() -> None:
    reports = _reports()
    reports[5] = reports[7] = SPARE_REPORT
    with pytest.raises(RecoveryImpossible, match=r"replicated bytes of ranks \[5, 7\] are "
                                                 r"lost.*holders \[5, 7\]"):
        plan_recovery(reports, {5, 7}, BUDDY, REPLICA, 4, holders=HOLDERS)
    # The same deaths with whole copies at the buddies recover.
    whole = _reports(partial=False)
    whole[5] = whole[7] = SPARE_REPORT
    assert plan_recovery(whole, {5, 7}, BUDDY, REPLICA, 4, holders=HOLDERS).target == 4


def test_report_round_trips_with_its_partial_copies() -> None:
    rep = _reports()[0]
    assert RankReport.from_plain(rep.plain()) == rep
    with pytest.raises(ValueError):
        RankReport.from_plain({**rep.plain(), "ward_partial": ["x"]})


def test_host_zero_refuses_a_hot_swap_that_lost_rank_and_source_together() -> None:
    from deadpool_megatron.control.policy import check_recoverable

    check_recoverable(1, {5}, 8, RPN, False, HOLDERS)  # the source (7) lives
    with pytest.raises(RecoveryImpossible, match=r"replicated bytes of ranks \[5, 7\] are "
                                                 r"lost.*holders, \[\[7\], \[5\]\]"):
        check_recoverable(1, {5, 7}, 8, RPN, False, HOLDERS)
    check_recoverable(1, {5, 7}, 8, RPN, False, [[]] * 8)  # whole copies at the buddies


# TP2 x DP4 on two nodes of four ranks: each rank has three data-parallel peers, so a
# source lost too leaves two more holders of the same bytes.
SIZES4 = ParallelSizes(tp=2, pp=1, dp=4)
RPN4 = 4
REPLICA4 = [coord_of(r, SIZES4).dp for r in range(8)]
BUDDY4 = buddy_map(8, RPN4)
HOLDERS4 = replica_holders(SIZES4, RPN4)


def test_a_source_lost_too_hands_the_region_to_the_next_holder() -> None:
    assert HOLDERS4[2] == (4, 6, 0) and HOLDERS4[4] == (0, 2, 6)
    reports = _reports()
    reports[2] = reports[4] = SPARE_REPORT  # rank 2 and its source, rank 4, both lost
    plan = plan_recovery(reports, {2, 4}, BUDDY4, REPLICA4, 4, holders=HOLDERS4)
    assert plan.target == 4 and plan.restore[2] == plan.restore[4] == "buddy"
    assert plan.replica_from[2] == 6 and plan.replica_from[4] == 0
    assert {r for r, src in enumerate(plan.replica_from) if src is not None} == {2, 4}
    # A sender never receives: no rank both takes a region and gives one.
    senders = {src for src in plan.replica_from if src is not None}
    assert not senders & {r for r, src in enumerate(plan.replica_from) if src is not None}


def test_the_next_holder_must_hold_the_target_in_its_own_slots() -> None:
    reports = _reports()
    reports[2] = reports[4] = SPARE_REPORT
    reports[6] = dataclasses.replace(reports[6], own=(3, 2))  # 6 no longer holds 4
    plan = plan_recovery(reports, {2, 4}, BUDDY4, REPLICA4, 4, holders=HOLDERS4)
    assert plan.target == 4 and plan.replica_from[2] == 0  # the holder on rank 2's own node
    reports[0] = dataclasses.replace(reports[0], own=(3, 2))  # nobody left holds 4 whole
    plan = plan_recovery(reports, {2, 4}, BUDDY4, REPLICA4, 4, holders=HOLDERS4)
    assert plan.target == 3 and plan.replica_from[2] == 6 and plan.replica_from[4] == 0


def test_a_rank_lost_while_no_holder_keeps_the_snapshot_is_refused() -> None:
    reports = _reports()
    reports[2] = reports[4] = SPARE_REPORT
    for r in (0, 6):  # alive, but their own slots no longer hold what the buddies do
        reports[r] = dataclasses.replace(reports[r], own=(2,))
    with pytest.raises(RecoveryImpossible, match=r"replicated bytes of ranks \[2, 4\] are "
                                                 r"lost.*holders \[0, 2, 4, 6\]"):
        plan_recovery(reports, {2, 4}, BUDDY4, REPLICA4, 4, holders=HOLDERS4)


def test_host_zero_takes_a_rank_lost_with_its_source_while_another_holder_lives() -> None:
    from deadpool_megatron.control.policy import check_recoverable

    holders = [list(h) for h in HOLDERS4]  # as published (JSON)
    check_recoverable(1, {2, 4}, 8, RPN4, False, holders)  # 2's source (4) is lost: 6 holds
    # (every holder of a rank lost too takes its buddy with it here: the shard rule refuses)


@pytest.mark.parametrize("chunk", [64, 100, 1 << 20])
def test_copy_and_tabulate_is_one_pass_equal_to_the_separate_checksums(chunk: int) -> None:
    from deadpool_megatron.snapshot.manifest import copy_and_tabulate

    model, holder = _model_and_optimizer()
    m = build_manifest([model], holder, distributed_optimizer=True)  # both regions
    flat = torch.zeros(m.nbytes, dtype=torch.uint8)
    table, unique, seconds = copy_and_tabulate(m, flat, chunk, b"objects")
    split = m.replicated_nbytes
    assert table == chunk_table(flat, split, chunk) and seconds >= 0
    assert unique == unique_checksum(flat, split, table, b"objects")
    slot = Slot(flat)
    slot.seal(2, b"objects", None)  # no whole checksum computed
    slot.seal_regions(split, table, unique, chunk=chunk)
    assert slot.verify()  # checked by table and unique checksum
    flat[split // 2] ^= 1  # a replicated byte: caught by the table
    assert not slot.verify()
    flat[split // 2] ^= 1
    assert slot.verify() and slot.whole_crc() == checksum(flat, b"objects")
