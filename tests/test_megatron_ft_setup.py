"""pretrain()'s ft_integration.setup() under hot-swap reads --enable-ft-package from the
parsed arguments instead of parsing Megatron's whole command line again (0.2 s of a spare's
0.26 s build alone)."""

from __future__ import annotations

import argparse

import pytest

from deadpool_megatron.integration.megatron_ft_setup import skipping_reparse
from deadpool_megatron.rehearsal import prepare_megatron_import
from deadpool_megatron.rehearsal.imports import provide_typing_override


def test_setup_runs_only_with_the_ft_package_on() -> None:
    calls = []

    def setup(*args: object, **kwargs: object) -> str:
        calls.append((args, kwargs))
        return "set up"

    enabled = [False]
    wrapped = skipping_reparse(setup, lambda: enabled[0])
    assert wrapped() is None and calls == []
    enabled[0] = True
    assert wrapped(1, key=2) == "set up" and calls == [((1,), {"key": 2})]
    assert wrapped.__name__ == "setup"


@pytest.mark.parametrize("ft_package", [False, True])
def test_megatrons_setup_parses_nothing_again_inside(monkeypatch, ft_package: bool) -> None:  # noqa: ANN001
    prepare_megatron_import(True)
    provide_typing_override()
    from megatron.training import arguments, ft_integration, global_vars

    from deadpool_megatron.integration.megatron_ft_setup import on_parsed_arguments

    parsed = []

    def parse_args(*args: object, **kwargs: object) -> argparse.Namespace:
        parsed.append(kwargs)
        raise RuntimeError("stop here: the FT package's own set-up follows the parse")

    monkeypatch.setattr(arguments, "parse_args", parse_args)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS",
                        argparse.Namespace(enable_ft_package=ft_package))
    original = ft_integration.setup
    with on_parsed_arguments():
        if ft_package:  # Megatron's own setup, which parses as it always did
            with pytest.raises(RuntimeError, match="stop here"):
                ft_integration.setup()
            assert parsed == [{"ignore_unknown_args": True}]
        else:
            assert ft_integration.setup() is None
            assert parsed == []
    assert ft_integration.setup is original
    with pytest.raises(RuntimeError, match="stop here"):  # outside: Megatron's as it was
        ft_integration.setup()
