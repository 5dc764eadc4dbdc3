"""The OpenMP wait setting tnlg gives torch's threads: set before torch loads libgomp, a user's own
setting left alone."""

import subprocess
import sys

from tnlg.runtime.spawn import checkout_env
from tnlg.runtime.threads import SPIN_COUNT, set_wait_policy


def test_set_wait_policy_keeps_a_users_setting():
    env = {}
    assert set_wait_policy(env) and env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(user)
        assert not set_wait_policy(env) and env == user


def test_tnlg_command_sets_it_before_torch_loads():
    """The command line sets it first thing (no torch yet), so its own libgomp and every worker it starts
    read it; a user's OMP_WAIT_POLICY wins."""
    code = ("import os, sys; from tnlg.cli import main; main([]); "
            "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in checkout_env().items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == f"False {SPIN_COUNT}"
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, OMP_WAIT_POLICY="ACTIVE"), capture_output=True,
                         text=True, check=True)
    assert out.stdout.splitlines()[-1] == "False None"
