"""Files outside the run folder: matplotlib's cache goes under tnlg's cache folder, never ~/.cache/matplotlib."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

_PLOT = """
import json, sys
from tnlg.training.metrics import plot_loss
path = sys.argv[1]
with open(path, "w") as f:
    for i in range(1, 4):
        f.write(json.dumps({"iteration": i, "loss": 5.0 - i}) + "\\n")
plot_loss(path)
import matplotlib
print(json.dumps({"configdir": matplotlib.get_configdir(), "cachedir": matplotlib.get_cachedir()}))
"""


def _plot_in_fresh_process(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")}
    base.update(HOME=str(tmp_path / "home"), TNLG_CACHE=str(tmp_path / "cache"), **env)
    out = subprocess.run([sys.executable, "-c", _PLOT, str(tmp_path / "metrics.jsonl")], env=base, check=True,
                         capture_output=True, text=True).stdout
    assert os.path.isfile(tmp_path / "metrics_loss.png")
    return json.loads(out.strip().splitlines()[-1])


def test_matplotlib_cache_stays_in_the_tnlg_cache_folder(tmp_path):
    (tmp_path / "home").mkdir()
    dirs = _plot_in_fresh_process(tmp_path)
    assert dirs["configdir"] == dirs["cachedir"] == str(tmp_path / "cache" / "matplotlib")
    assert os.listdir(tmp_path / "home") == []  # no ~/.cache/matplotlib, no ~/.config/matplotlib


def test_a_users_mplconfigdir_is_kept(tmp_path):
    (tmp_path / "home").mkdir()
    mine = tmp_path / "mine"
    dirs = _plot_in_fresh_process(tmp_path, MPLCONFIGDIR=str(mine))
    assert dirs["configdir"] == str(mine) and not (tmp_path / "cache" / "matplotlib").exists()
