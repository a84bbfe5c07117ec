"""Test-session set-up: eight forced host devices for the sharding tests, unoptimised XLA:CPU
code, one OpenBLAS thread per worker, F32-exact matmuls, a persistent compilation cache in the
checkout, compiled programs released after each test file, and the ``gpu`` marker (tests that
only make sense on a GPU; they skip elsewhere)."""

import gc
import os
from pathlib import Path

# Must be set before JAX initialises its backends; tests only, never library code. The tests'
# time goes mostly to compiling small programs, so XLA:CPU skips its LLVM optimisation passes
# (about a fifth of the suite's CPU time); the tests' tolerances hold at either level.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
# NumPy's OpenBLAS starts a thread per core whose workers spin after each product; the tests'
# NumPy products are tiny, and two xdist workers already keep every core busy, so the spinning
# only takes time from the other worker (about 5% of eight long files' wall time on two cores).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# One persistent compilation cache for both xdist workers and the subprocesses the tests start
# (the notebook's kernel, the scripts run from a checkout): a program compiled once is read back
# wherever else it is built, in this run and the next. JAX keys an entry by the program, the
# compile options and its own version, so an entry never stands in for a changed program; the
# least recently used entries go past 512 MB.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "jax-tests")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(512 * 2**20))

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU (run there with `pytest -m gpu`)")
    # xdist hands out `--dist loadfile` files by their number of tests, most first, unless told
    # to keep the collection's order: the order below is the one that balances the workers.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The longest test files (tens of seconds of CPU each, longest first), started before the
# rest so that the two xdist workers do not end on one of them while the other idles; the many
# short files, in collection order after them, fill the gaps.
_LONGEST_FIRST = (
    "test_generate.py",
    "test_measure_acceptance.py",
    "test_finetune_cli.py",
    "test_notebook.py",
    "test_tree.py",
    "test_bench_propose.py",
    "test_bench_generate.py",
    "test_mla.py",
    "test_nextn_fixtures.py",
    "test_drafter_parallel.py",
    "test_train_smoke.py",
    "test_readme.py",
    "test_draft_length.py",
    "test_pretrained.py",
    "test_kernels_gemv_mosaic.py",
    "test_kernels_stacked.py",
    "test_train.py",
    "test_propose.py",
    "test_hybrid.py",
    "test_bench_hybrid.py",
    "test_convert.py",
    "test_generate_families.py",
    "test_sampled_drafts.py",
    "test_demo.py",
)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program once a test file is done.

    Each XLA:CPU executable keeps three memory mappings (its code, read-only data and data) for as
    long as a jit cache holds it, and an xdist worker compiles thousands of programs: one worker of
    the whole suite reached 63,978 mappings against Linux's default limit of 65,530, past which
    XLA:CPU's next compile or serialisation fails to map memory and the worker dies with SIGSEGV.
    Programs a later file needs are compiled again there.
    """
    yield
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
