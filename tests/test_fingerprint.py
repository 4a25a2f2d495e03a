"""The fingerprint sees every bit of parameters, optimizer state and step counters."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deadpool_megatron.integration.fingerprint import combine, rank_digest


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return [model], SimpleNamespace(optimizer=opt), SimpleNamespace(num_steps=8)


def test_identical_state_identical_digest() -> None:
    assert rank_digest(*_objects()) == rank_digest(*_objects())


def test_one_bit_of_a_parameter_changes_the_digest() -> None:
    model, opt, sched = _objects()
    before = rank_digest(model, opt, sched)
    with torch.no_grad():
        w = model[0].weight.view(-1)
        w[0] = torch.nextafter(w[0], torch.tensor(1e9))
    assert rank_digest(model, opt, sched) != before


def test_optimizer_moment_and_step_counters_are_covered() -> None:
    model, opt, sched = _objects()
    before = rank_digest(model, opt, sched)
    state = opt.optimizer.state[model[0].weight]
    v = state["exp_avg_sq"]
    v[0, 0] = torch.nextafter(v[0, 0], torch.tensor(1e9))
    assert rank_digest(model, opt, sched) != before
    model, opt, sched = _objects()
    sched.num_steps += 8
    assert rank_digest(model, opt, sched) != before


def test_combination_depends_on_rank_order() -> None:
    assert combine([b"a" * 32, b"b" * 32]) != combine([b"b" * 32, b"a" * 32])
