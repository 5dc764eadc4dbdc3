"""The lanes of tests/lanes.py name modules that exist, and order a worker's tests as they say."""

import os
from types import SimpleNamespace

from . import lanes

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_module_the_lanes_name_exists_once():
    named = lanes.WAITS + lanes.LONGEST
    assert len(set(named)) == len(named), "a module named twice, or in both lists"
    missing = [m for m in named if not os.path.exists(os.path.join(HERE, m + ".py"))]
    assert not missing, f"tests/lanes.py names modules that are gone: {missing}"


def test_waits_are_one_unit_and_each_other_module_its_own():
    assert lanes.unit_of("tests/test_hang.py::test_a[x-1]") == lanes.unit_of("tests/test_faults.py::test_b") == "waits"
    assert lanes.unit_of("tests/test_zero.py::test_c[world4]") == "test_zero"
    assert lanes.unit_of("tests/test_checkpoint.py::test_d") == "test_checkpoint"


def test_order_puts_the_waits_first_then_the_longest_and_keeps_each_modules_order():
    ids = ["tests/test_zero.py::a", "tests/test_checkpoint.py::b", "tests/test_hang.py::c",
           "tests/test_pretrain_e2e.py::d", "tests/test_zero.py::e", "tests/test_faults.py::f",
           "tests/test_checkpoint.py::g"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    lanes.order(items)
    assert [i.nodeid.rpartition("::")[2] for i in items] == ["c", "f", "d", "b", "g", "a", "e"]


def test_the_suite_loads_without_pytest_xdist(tmp_path):
    """The scheduler hook is xdist's: without the plugin (a plain ``pip install pytest``), conftest still loads."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "--collect-only", os.path.join(HERE, "test_lanes.py")],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
