import os

import pytest
import torch

torch.set_num_threads(1)  # spawned ranks share the 2 cores; keep the parent off them

# (world_size, tp): the layouts a distributed test body runs at: one process; all tensor-parallel on 2 and 4;
# all data-parallel on 2; TP 2 x DP 2 on 4
LAYOUTS = [(1, 1), (2, 2), (2, 1), (4, 4), (4, 2)]


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (tiny models: faster, much faster on a busy machine),
    restored afterwards in case a test of another module changed it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _cache_in_a_temporary_folder(tmp_path_factory):
    """Tests write only to temporary folders: the built-in corpus (prepared once per session, about 2 s)
    and every dataset index cache go to this session's folder, not to ``~/.cache/tnlg``, which they
    used to fill with index-cache files. Spawned workers inherit the variable."""
    # torch.compile's caches too (default /tmp/torchinductor_<user>): a cache kept between runs would hide
    # a change to a custom operator's fake implementation, which inductor's cache key does not see
    folders = {"TNLG_CACHE": "tnlg_cache", "TORCHINDUCTOR_CACHE_DIR": "inductor_cache"}
    before = {name: os.environ.get(name) for name in folders}
    for name, folder in folders.items():
        os.environ[name] = str(tmp_path_factory.mktemp(folder))
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
