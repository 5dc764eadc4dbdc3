import importlib.util
import os

import pytest

from . import lanes
import tnlg  # noqa: F401  (before torch: the OpenMP wait setting the command gives, tnlg/__init__.py)
import torch  # noqa: E402,I001

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


@pytest.fixture(autouse=True)
def _threads_given_back():
    """``tnlg.init_parallel`` gives the process a command worker's threads (all the cores, alone): a test that
    calls it in this process gives the next test back the threads it found."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _cache_in_a_temporary_folder(request, tmp_path_factory):
    """Tests write only to temporary folders: the built-in corpus (prepared once per run, about 2 s)
    and every dataset index cache go to this run's folder, not to ``~/.cache/tnlg``, which they
    used to fill with index-cache files. Spawned workers inherit the variable."""
    # torch.compile's caches too (default /tmp/torchinductor_<user>): a cache kept between runs would hide
    # a change to a custom operator's fake implementation, which inductor's cache key does not see
    folders = {"TNLG_CACHE": "tnlg_cache", "TORCHINDUCTOR_CACHE_DIR": "inductor_cache"}
    before = {name: os.environ.get(name) for name in folders}
    for name, folder in folders.items():
        os.environ[name] = str(_run_folder(request.config, tmp_path_factory, folder))
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _run_folder(config, tmp_path_factory, name: str):
    """A folder for this run: under pytest-xdist, one that every worker of the run shares (the parent of the
    workers' own temporary folders, which is new for each run), so a kernel inductor compiled or the corpus
    one worker prepared serves the other (both caches take concurrent writers: inductor's compiling ranks,
    test_preprocess's concurrent prepare); in one process, a folder of its own."""
    if not hasattr(config, "workerinput"):
        return tmp_path_factory.mktemp(name)
    folder = tmp_path_factory.getbasetemp().parent / name
    folder.mkdir(exist_ok=True)
    return folder


# The optional packages a test may need (``@pytest.mark.needs_package("tensorboard", ...)``), each with the
# command that installs it as the README says. Without one, the test is skipped with that command as its
# reason; with ``--require-optional`` (the second pass of .ci/run, once they are installed) it fails instead.
OPTIONAL_PACKAGES = {
    "tensorboard": 'pip install -e ".[loggers]"',
    "wandb": 'pip install -e ".[loggers]"',
    "pyarrow": 'pip install -e ".[parquet]"',
    "datasets": "pip install datasets",
    "rouge_score": 'pip install -e ".[eval]"',
    "megatron.core": "pip install --no-deps megatron-core==0.16.1 && pip install numpy packaging psutil",
    "deepspeed": 'pip install --no-build-isolation "deepspeed>=0.14"',
    "lm_eval": 'pip install -e ".[harness]"',
    "fastapi": 'pip install -e ".[serve]"',
    "uvicorn": 'pip install -e ".[serve]"',
    "openai": 'pip install -e ".[test-serve]"',
    "selenium": 'pip install -e ".[test-serve]" (and apt-get install -y chromium chromium-driver)',
    "peft": "pip install --no-deps peft==0.21.2 accelerate && pip install pyyaml psutil",
}


# The quick tier (``-m quick``): every test that is not marked slow, except those of these modules, whose
# tests compile, start fresh processes (faults, signals, launchers, fuzzers under resource limits) or run
# megatron-core, DeepSpeed or a benchmark's smoke run. The README states its time; .ci/run runs it first.
NOT_QUICK = {"test_bench_peers", "test_checkpoint", "test_compile", "test_deepspeed", "test_failures",
             "test_fuzz_megatron", "test_fuzz_readers", "test_gpu_check", "test_hang", "test_imports",
             "test_megatron_attention", "test_megatron_bad_input", "test_megatron_checkpoint", "test_megatron_llama",
             "test_megatron_model_options", "test_megatron_optimizer", "test_megatron_resume", "test_memory_scale",
             "test_pipeline_compile", "test_pipeline_precision", "test_eval_harness", "test_serve", "test_serve_browser",
             "test_stop_signals"}


def pytest_collection_modifyitems(config, items):
    """Mark the quick tier (``NOT_QUICK``); in an xdist worker, order the tests as the lanes run them."""
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
        if item.get_closest_marker("slow") is None and module not in NOT_QUICK:
            item.add_marker(pytest.mark.quick)
    if hasattr(config, "workerinput"):
        lanes.order(items)


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist: without it, never called)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N``: the lanes of tests/lanes.py (a lane of waits beside one of work), not xdist's own."""
    return lanes.scheduler(config, log)


def pytest_addoption(parser):
    parser.addoption("--require-optional", action="store_true",
                     help="a test marked needs_package whose package is missing fails instead of skipping "
                          "(and so does any other skip of such a test for a package that cannot be imported)")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package ("megatron" of "megatron.core") is missing
        return False


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_package"):
        unknown = [n for n in mark.args if n not in OPTIONAL_PACKAGES]
        assert not unknown, f"needs_package({unknown}): not in tests/conftest.py's OPTIONAL_PACKAGES"
        missing = [n for n in mark.args if not _installed(n)]
        if missing:
            reason = "; ".join(f"needs the optional package {n} ({OPTIONAL_PACKAGES[n]})" for n in missing)
            if item.config.getoption("--require-optional"):
                pytest.fail(f"--require-optional: {reason}", pytrace=False)
            pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``--require-optional``, a needs_package test that skips anyway because an import failed
    (``pytest.importorskip`` inside it) is a failure: the pass exists to run these tests."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and item.config.getoption("--require-optional")
            and item.get_closest_marker("needs_package") is not None):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "could not import" in reason or "not installed" in reason:
            report.outcome, report.longrepr = "failed", f"--require-optional: skipped: {reason}"
