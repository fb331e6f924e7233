import os

# Eight CPU devices for the pmap / sharding tests; set before jax starts. Single-device code runs on device 0.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
