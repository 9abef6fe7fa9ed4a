"""The unit lane (``pytest -m unit``, tests/conftest.py): a test is marked unit unless what it
runs reaches a checkpoint, a model, a server or a process, found by following its code into
its helpers and fixtures; a unit test that does one anyway, out of the walk's sight, fails
naming what it did. Run on a pytest of its own (pytester) with this folder's conftest."""

from pathlib import Path

INNER = '''
import subprocess
import sys

import pytest

import mlx_dspark as md
from testkit.toy import tiny_target


def load_it():
    return md.load()


@pytest.fixture
def pair():
    return load_it()


def test_arithmetic():
    assert 1 + 1 == 2


def test_a_helper_loads_the_demo_pair():
    assert load_it() is not None


def test_a_fixture_loads_the_demo_pair(pair):
    assert pair is not None


def test_a_toy_model():
    assert tiny_target() is not None


def test_a_process():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_a_load_out_of_sight():
    getattr(md, "lo" + "ad")()


def test_a_process_out_of_sight():
    getattr(subprocess, "ru" + "n")([sys.executable, "-c", "pass"])
'''


def test_the_unit_lane_leaves_out_what_loads_builds_or_starts_and_catches_what_it_missed(
        pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-m", "unit", "-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=1, failed=2, deselected=4)
    out = result.stdout.str()
    assert "test_a_load_out_of_sight - " in out and "a unit test read a checkpoint" in out
    assert "test_a_process_out_of_sight - " in out and "a unit test started a process" in out
