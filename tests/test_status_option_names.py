"""The options table names each plugin flag as a user types it to get the value shown."""

import argparse
import types

from mlx_lm_ext.api import hookimpl


def _plugin():
    @hookimpl
    def commands():
        return ["server"]

    @hookimpl
    def add_arguments(command, group):
        group.add_argument("--opt-verify", action=argparse.BooleanOptionalAction, default=True)
        group.add_argument("-w", "--opt-width", type=int, default=4)
        group.add_argument("--no-opt-thing", action="store_true")

    return types.SimpleNamespace(
        commands=commands, add_arguments=add_arguments, __name__="optnames"
    )


def test_a_negatable_switch_is_named_by_its_positive_form(host):
    host.manager().register(_plugin(), name="optnames")
    try:
        names = host.flags("optnames", "server")
    finally:
        host.manager().unregister(name="optnames")
    # shown as "--opt-verify on"; "--no-opt-verify on" would read as the opposite
    assert names == {
        "opt_verify": "--opt-verify",
        "opt_width": "--opt-width",
        "no_opt_thing": "--no-opt-thing",
    }
