import os

import pytest

# pytest-xdist runs the suite on two workers (`-n 2`, README): torch's OpenMP threads would spin against the other
# worker's on a small machine, so each worker's torch keeps to one thread (its results do not depend on it). Set
# before torch loads (the builders import it).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from compile_flags import xla_flags  # noqa: E402

# Eight CPU devices for the pmap / sharding tests; set before jax starts. Single-device code runs on device 0.
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach the hub
# sdflax's cache folder (compiled programs, parameter shapes): one per test session, never the user's.
if "SDFLAX_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["SDFLAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="sdflax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SDFLAX_CACHE_DIR"], ignore_errors=True)

# Compiled programs kept in that folder, as the command line keeps them: a worker process or a later test that
# compiles the same program loads it.
import sdflax  # noqa: E402

sdflax.enable_compile_cache()


# The slowest modules first (measured with two workers): pytest-xdist hands out whole files (`--dist loadfile`) in
# collection order, so the two workers finish together only if the long files start early.
SLOWEST_FIRST = ["test_docs.py", "test_demo.py", "test_accelerator_report.py", "test_run_modes.py", "test_train.py",
                 "test_batch_invariance.py", "test_train_cli.py", "test_train_cli_hosts.py", "test_sampler_hooks.py",
                 "test_inpaint.py", "test_controlnet.py", "test_flux_controlnet.py", "test_pipeline.py",
                 "test_cli_controlnet.py", "test_controlnet_xl_images.py", "test_sdxl_img2img.py", "test_models.py",
                 "test_batch.py", "test_guiders.py", "test_img2img.py", "test_sdxl.py", "test_guiders_perturbed.py",
                 "test_ip_adapter.py", "test_guiders_fdg.py", "test_t2i_adapter_pipelines.py",
                 "test_cli_ip_adapter.py", "test_train_cli_caches.py", "test_cli_xl.py", "test_cli_sd3.py",
                 "test_hooks_prompt_to_prompt_joint.py"]


@pytest.fixture(autouse=True)
def xla_flags_kept():
    """XLA_FLAGS stays as the worker started with it: a test (or a module it imports) that changes it changes what
    every later subprocess of the worker compiles, and so its numbers (a resumed training run's LoRA was no longer
    its in-process reference's, bit for bit). The test that changes it fails, and the value is put back."""
    before = os.environ.get("XLA_FLAGS")
    yield
    after = os.environ.get("XLA_FLAGS")
    if after != before:
        os.environ.pop("XLA_FLAGS") if before is None else os.environ.update(XLA_FLAGS=before)
        pytest.fail(f"XLA_FLAGS changed from {before!r} to {after!r}: set it only in a subprocess's own env")


def pytest_configure(config):
    # pytest-xdist 3.6+ hands out the files by their number of tests, most first (`--loadscope-reorder`, its
    # default), which put the long files of few tests (test_batch_invariance.py, test_controlnet_xl_images.py) last:
    # one worker then ran them alone. Collection order it is.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests stay in order


# Where the suite's time goes: with SDFLAX_TEST_COMPILE_REPORT=FILE, each process appends one line per test module,
# "<seconds compiling> <programs traced> <module>" (tracing, lowering and XLA's compile or the cache's load).
_REPORT = os.environ.get("SDFLAX_TEST_COMPILE_REPORT")
if _REPORT:
    import collections

    import jax
    import pytest

    _compiles = collections.defaultdict(lambda: [0.0, 0])
    _test = ["(collection)"]  # the running test's node id

    _programs = []  # each trace, lowering and compile: "<seconds> <event> <program> <test>"

    def _listen(event, seconds, fun_name="?", **_):
        if event.startswith("/jax/core/compile/"):
            module = _compiles[_test[0].split("::")[0]]
            module[0] += seconds
            module[1] += event == "/jax/core/compile/jaxpr_trace_duration"
            _programs.append(f"{seconds:.3f} {event.rsplit('/', 1)[1]} {fun_name} {_test[0]}\n")

    jax.monitoring.register_event_duration_secs_listener(_listen)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _test[0] = item.nodeid
        yield

    def pytest_sessionfinish(session):
        with open(_REPORT, "a") as report:
            report.writelines(f"{seconds:.1f} {count} {module}\n" for module, (seconds, count) in _compiles.items())
        with open(_REPORT + ".programs", "a") as programs:
            programs.writelines(_programs)
