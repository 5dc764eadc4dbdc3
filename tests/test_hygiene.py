"""Files outside the run folder: the suite keeps its caches in temporary folders, and matplotlib's cache goes
under tnlg's cache folder, never ~/.cache/matplotlib."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed")

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


def test_tests_keep_caches_in_temporary_folders():
    """The suite writes no cache under ~/.cache/tnlg (it used to leave ~100 index-cache files there: runs on
    the built-in corpus write their index caches next to it). tests/conftest.py points TNLG_CACHE at a
    session folder."""
    from tnlg.data.corpus import default_cache_dir, default_dataset

    home_cache = Path.home() / ".cache" / "tnlg"
    assert os.environ.get("TNLG_CACHE") and default_cache_dir() != home_cache
    prefix, _tokenizer = default_dataset()  # (the tokenizer model ships with the package)
    assert Path(prefix).is_relative_to(default_cache_dir())
    assert not Path(prefix).is_relative_to(home_cache)


@needs_matplotlib
def test_matplotlib_cache_stays_in_the_tnlg_cache_folder(tmp_path):
    (tmp_path / "home").mkdir()
    dirs = _plot_in_fresh_process(tmp_path)
    assert dirs["configdir"] == dirs["cachedir"] == str(tmp_path / "cache" / "matplotlib")
    assert os.listdir(tmp_path / "home") == []  # no ~/.cache/matplotlib, no ~/.config/matplotlib


@needs_matplotlib
def test_a_users_mplconfigdir_is_kept(tmp_path):
    (tmp_path / "home").mkdir()
    mine = tmp_path / "mine"
    dirs = _plot_in_fresh_process(tmp_path, MPLCONFIGDIR=str(mine))
    assert dirs["configdir"] == str(mine) and not (tmp_path / "cache" / "matplotlib").exists()
