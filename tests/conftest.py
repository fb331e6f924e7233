import os

# Eight CPU devices for the pmap / sharding tests; set before jax starts. Single-device code runs on device 0.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach the hub
