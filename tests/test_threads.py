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


def _python(code: str, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in checkout_env().items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.run([sys.executable, "-c", code], env=dict(env, **env_extra), capture_output=True, text=True,
                          check=True)


def test_import_tnlg_before_torch_sets_it_for_a_users_script():
    """A script of the README's shape (``import tnlg, torch``) gets the command's setting: tnlg sets it while
    torch is not loaded yet, so the libgomp that ``import torch`` then loads reads it; no warning."""
    out = _python("import os, sys, tnlg; print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT')); "
                  "import torch; print(torch.ones(2).sum().item())")
    assert out.stdout.splitlines()[0] == f"False {SPIN_COUNT}"
    assert "RuntimeWarning" not in out.stderr, out.stderr
    out = _python("import os, tnlg; print(os.environ.get('GOMP_SPINCOUNT'))", OMP_WAIT_POLICY="PASSIVE")
    assert out.stdout.strip() == "None"  # the user's own policy wins


def test_import_tnlg_after_torch_warns_once_what_to_do():
    """torch first: its libgomp has read the default (spin-waiting) policy and nothing tnlg sets now
    changes it, so tnlg says once what to do; not when the user set a policy."""
    out = _python("import torch, tnlg; import tnlg.model")
    lines = [line for line in out.stderr.splitlines() if "import tnlg before torch" in line]
    assert len(lines) == 1, out.stderr
    assert "GOMP_SPINCOUNT=1000" in lines[0] and "RuntimeWarning" in lines[0]
    assert "<string>:1" in lines[0]  # points at the user's import, not inside tnlg
    for policy in ({"GOMP_SPINCOUNT": "1000"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        out = _python("import torch, tnlg", **policy)
        assert "import tnlg before torch" not in out.stderr, out.stderr
