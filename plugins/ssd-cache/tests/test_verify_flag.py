"""``--ssd-cache-verify``: on by default, ``--no-ssd-cache-verify`` turns it off."""

import argparse

import pytest

from mlx_lm_ssd_cache import SSDPromptCache, plugin


def verify_of(*argv):
    parser = argparse.ArgumentParser()
    plugin.add_arguments("server", parser.add_argument_group("ssd-cache"))
    args = parser.parse_args(list(argv))
    return plugin.options(args)[2]


@pytest.mark.parametrize(
    "argv,want",
    [((), True), (("--ssd-cache-verify",), True), (("--no-ssd-cache-verify",), False)],
)
def test_verify_flag(argv, want):
    assert verify_of(*argv) is want


def test_python_default_verifies(tmp_path):
    cache = SSDPromptCache(1, directory=tmp_path)
    assert cache.disk.verify
    cache.close()
