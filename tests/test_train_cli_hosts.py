"""`sdflax train` over several processes (--coordinator, two on this machine's CPU) and on a disk that fills up.

The reference is one process splitting each update's rows over two devices (--devices 2); two processes of one device
each continue its checkpoint and end with its LoRA, each having read only its own rows."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_cli import TINY, make_data, relative

from sdflax.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
SEED = 5
HOSTS = ["--model", TINY, "--resolution", "32", "--no-progress", "--seed", str(SEED), "--max-train-steps", "4",
         "--train-batch-size", "2", "--checkpointing-steps", "2", "--learning-rate", "1e-3"]


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    """One process, each update's two rows over two devices: the reference run (--out, --data)."""
    folder = tmp_path_factory.mktemp("train-hosts")
    data = make_data(folder / "data")
    out = folder / "one-process"
    assert main(["train", "lora", "--data", str(data), "--out", str(out), "--devices", "2", *HOSTS]) == 0
    return out, data


def subprocess_env():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                          os.environ.get("PYTHONPATH", "")])}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    return env


def test_two_processes_continue_a_checkpoint_each_reading_its_rows_to_the_same_lora(two_devices, tmp_path):
    """Process 0 continues the reference's checkpoint-2 (its --out a copy of the reference's, the result and
    checkpoint-4 removed); process 1's --out is an empty folder of its own, as on a host that does not share the
    disk: the first process reads the checkpoint and sends it to the other. Updates 3 and 4 split each update's two
    rows, one a process: each reads its own row of each update (the data reader's log), the first process writes
    checkpoint-4 and the LoRA (the other writes nothing), and the LoRA is the reference's."""
    from sdflax.loading.files import read_safetensors
    from sdflax.train.data import batch_at

    reference, data = two_devices
    outs = [tmp_path / "host0", tmp_path / "host1"]
    shutil.copytree(reference, outs[0])
    for path in (outs[0] / "pytorch_lora_weights.safetensors", outs[0] / "checkpoints" / "checkpoint-4"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    outs[1].mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = str(ROOT / "tests" / "train_cli_multihost_worker.py")
    processes = [subprocess.Popen([sys.executable, worker, str(tmp_path / f"reads{i}.txt"), "train", "lora", "--data",
                                   str(data), "--out", str(outs[i]), *HOSTS, "--coordinator", f"127.0.0.1:{port}",
                                   "--num-processes", "2", "--process-id", str(i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())
                 for i in range(2)]
    printed = []
    for p in processes:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err.decode()[-3000:]
        printed.append([line for line in out.decode().splitlines() if not line.startswith("[Gloo]")])
    assert printed == [[str(outs[0] / "pytorch_lora_weights.safetensors")], []]  # the first process's result

    ours, theirs = (read_safetensors(folder / "pytorch_lora_weights.safetensors") for folder in (outs[0], reference))
    assert sorted(ours) == sorted(theirs)
    assert max(relative(ours[name], theirs[name]) for name in ours) < 1e-6  # 0 measured: the same float32 sums
    assert sorted(os.listdir(outs[0] / "checkpoints")) == ["checkpoint-2", "checkpoint-4"]
    assert [p.name for p in outs[1].iterdir()] == [".sdflax-train.1.lock"]  # the other process wrote nothing
    for process in range(2):
        rows = [batch_at(step, [(32, 32)] * 4, [1] * 4, 2, SEED)[process] for step in (2, 3)]
        reads = (tmp_path / f"reads{process}.txt").read_text().split()
        assert reads == [str(data / f"p{i}.png") for i in rows], process


def can_mount_tmpfs(folder) -> bool:
    """Whether this machine lets a user namespace mount a tmpfs (unshare -rm: no root needed where it is allowed)."""
    import shutil as tools

    return tools.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {folder}"], capture_output=True).returncode == 0


def test_a_disk_that_fills_up_while_saving_keeps_the_last_checkpoint_and_the_run_continues(tmp_path):
    """A tmpfs of 1 MiB, 520 KiB of it taken: checkpoint-1 (310 kB) fits, checkpoint-2 fills the disk mid-write. The
    run ends in one line naming the checkpoint kept, leaving no partial one; room made, the same command continues
    from checkpoint-1 and completes. The updates are recorded, not made (tests/train_cli_full_disk_worker.py); where
    no tmpfs can be mounted, a file-size limit set after the first save fails the write alike (EFBIG)."""
    data = make_data(tmp_path / "data")
    disk = tmp_path / "disk"
    disk.mkdir()
    worker = str(ROOT / "tests" / "train_cli_full_disk_worker.py")
    command = f"{sys.executable} {worker} {{}}train lora --data {data} --out {disk}/out --model {TINY} " \
        "--resolution 32 --devices 1 --no-progress --seed 1 --max-train-steps 2 --train-batch-size 2 " \
        "--checkpointing-steps 1"
    if can_mount_tmpfs(disk):
        script = (f"mount -t tmpfs -o size=1m tmpfs {disk} && head -c 532480 /dev/zero > {disk}/ballast && "
                  f"{command.format('')} 2> {tmp_path}/first.err; echo $? > {tmp_path}/first.rc; "
                  f"ls {disk}/out/checkpoints > {tmp_path}/kept; rm {disk}/ballast; "
                  f"{command.format('')} --progress 2> {tmp_path}/second.err; echo $? > {tmp_path}/second.rc; "
                  f"cp {disk}/out/log.jsonl {disk}/out/pytorch_lora_weights.safetensors {tmp_path}")
        full = "No space left on device"
        subprocess.run(["unshare", "-rm", "sh", "-c", script], check=True, env=subprocess_env(), timeout=900)
    else:
        script = (f"{command.format('--fsize-after-first-save 100000 ')} 2> {tmp_path}/first.err; "
                  f"echo $? > {tmp_path}/first.rc; ls {disk}/out/checkpoints > {tmp_path}/kept; "
                  f"{command.format('')} --progress 2> {tmp_path}/second.err; echo $? > {tmp_path}/second.rc; "
                  f"cp {disk}/out/log.jsonl {disk}/out/pytorch_lora_weights.safetensors {tmp_path}")
        full = "File too large"
        subprocess.run(["sh", "-c", script], check=True, env=subprocess_env(), timeout=900)
    first = (tmp_path / "first.err").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "2", first
    assert "Traceback" not in first, first
    assert f"cannot save {disk}/out/checkpoints/checkpoint-2 ({full}); {disk}/out/checkpoints/checkpoint-1 is " \
        "kept: make room" in first
    assert (tmp_path / "kept").read_text().split() == ["checkpoint-1"]
    second = (tmp_path / "second.err").read_text()
    assert (tmp_path / "second.rc").read_text().strip() == "0", second
    assert f"continuing from {disk}/out/checkpoints/checkpoint-1 (update 1)" in second
    assert [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()] == [1, 2]
    assert (tmp_path / "pytorch_lora_weights.safetensors").stat().st_size > 0
