import os

import pytest
import torch

torch.set_num_threads(1)  # spawned ranks share the 2 cores; keep the parent off them

# (world_size, tp): the layouts every distributed test body runs at (GUIDE section 4)
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
    used to fill with index-cache files (issue 15 item 9). Spawned workers inherit the variable."""
    before = os.environ.get("TNLG_CACHE")
    os.environ["TNLG_CACHE"] = str(tmp_path_factory.mktemp("tnlg_cache"))
    yield
    if before is None:
        os.environ.pop("TNLG_CACHE", None)
    else:
        os.environ["TNLG_CACHE"] = before
