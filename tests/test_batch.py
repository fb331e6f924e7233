"""`sdflax batch` end to end on weights/tiny-sd, in subprocesses (signals, several processes); bad input in process
(it fails before JAX starts).

Every run shares one disk compile cache and the same static settings, so the batch program compiles once for one
process and once for a process of a two-process mesh, with the suite's compile options (compile_flags.py; the
library's images under a user's are tests/test_batch_invariance.py's). XLA_FLAGS keep the CPU's reductions out of
YNNPACK, whose order depends on the whole tensor (docs/batch.md, "One image, any batch"): images are then equal bit
for bit whatever the batch they are made in."""

import fnmatch
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from compile_flags import xla_flags
from PIL import Image

from sdflax.cli.batch import Line, read_prompts
from sdflax.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "weights" / "tiny-sd")
BIT_EXACT = "--xla_cpu_experimental_ynn_fusion_type=individual_dot,individual_convolution"
SIZE = ["--model", TINY, "--steps", "2", "--height", "32", "--width", "32", "--no-progress"]
SEED = 40
# 12 prompts on 13 lines (line 4 is blank): own seeds, three guidance scales, a negative prompt; lines 1, 11 and
# 13 share prompt and seed: 13 repeats 1 in another batch, 11 differs from it by its guidance only.
LINES = [{"prompt": "a red fox", "seed": 7}, {"prompt": "a blue bird", "guidance": 3.0, "negative_prompt": "blurry"},
         {"prompt": "a green tree"}, None, {"prompt": "a cat on a mat", "guidance": 9.0, "seed": 123},
         {"prompt": "a lighthouse"}, {"prompt": "a bowl of soup", "guidance": 3.0}, {"prompt": "mountains, dawn"},
         {"prompt": "a violin", "guidance": 9.0}, {"prompt": "a bicycle", "negative_prompt": "rust"},
         {"prompt": "a red fox", "seed": 7, "guidance": 3.0}, {"prompt": "a ship", "guidance": 9.0},
         {"prompt": "a red fox", "seed": 7}]
NUMBERS = [n for n, line in enumerate(LINES, 1) if line]


def env_for(tmp, devices):
    return {**os.environ, "XLA_FLAGS": xla_flags(devices, BIT_EXACT),
            "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "SDFLAX_CACHE_DIR": str(tmp / "jax-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # cache every program: no timing
            "PYTHONPATH": str(ROOT)}  # this checkout's sdflax, whatever is installed


def command(tmp, out, *extra):
    return [sys.executable, "-m", "sdflax", "batch", str(tmp / "prompts.jsonl"), "--out", str(out), *SIZE,
            "--seed", str(SEED), "--batch-per-device", "2", *extra]


def run(tmp, args, devices=2):
    return subprocess.run(args, cwd=tmp, env=env_for(tmp, devices), capture_output=True, text=True, timeout=600)


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def pngs(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(".png"))


def manifest(folder, name="manifest.jsonl"):
    path = folder / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    (tmp / "prompts.jsonl").write_text("\n".join(json.dumps(line) if line else "" for line in LINES) + "\n")
    return tmp


@pytest.fixture(scope="module")
def full_run(tmp):
    """One uninterrupted run, with its status lines: 12 images in batches of 4 (2 devices, 2 each), grouped by
    guidance."""
    done = run(tmp, [arg for arg in command(tmp, tmp / "full") if arg != "--no-progress"])
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def full(tmp, full_run):
    return tmp / "full"


def test_batch_says_what_it_compiles_as_generate_does(full_run):
    """Friction: `sdflax batch` printed nothing while it compiled (`generate` says "Compiling ..."). The three
    guidance scales share one program: one line."""
    compiling = [line for line in full_run.stderr.splitlines() if line.startswith("Compiling")]
    assert len(compiling) == 1, full_run.stderr
    assert re.fullmatch(r"Compiling for 2 steps at 32x32, 4 image\(s\) on 2 CPU devices \(once per setting; kept "
                        r"in .*jax-cache\) \.\.\.", compiling[0]), compiling
    lines = full_run.stderr.splitlines()
    assert lines.index(compiling[0]) < lines.index("batch: 4/12 images")  # before the first batch is written


def test_one_png_per_line_with_its_settings_and_a_manifest_listing_them(full):
    records = manifest(full)
    assert sorted(r["line"] for r in records) == NUMBERS
    assert pngs(full) == sorted(r["file"] for r in records)
    by_line = {r["line"]: r for r in records}
    assert by_line[1]["file"] == "000001-a-red-fox.png" and by_line[5]["file"] == "000005-a-cat-on-a-mat.png"
    for number in NUMBERS:
        line, record = LINES[number - 1], by_line[number]
        seed = line.get("seed", SEED + number - 1)  # line n: --seed + n - 1 unless it sets its own
        image = Image.open(full / record["file"])
        assert image.size == (32, 32) and record["seed"] == seed
        assert {k: image.text[k] for k in ("prompt", "negative_prompt", "seed", "guidance_scale", "steps")} == {
            "prompt": line["prompt"], "negative_prompt": line.get("negative_prompt", ""), "seed": str(seed),
            "guidance_scale": str(line.get("guidance", 7.5)), "steps": "2"}
        assert record["settings"]["guidance_scale"] == line.get("guidance", 7.5)
    assert pixels(full / by_line[1]["file"]).std() > 5  # not blank: equality means something


def test_an_image_depends_on_its_line_only_and_guidance_is_per_image(full):
    by_line = {r["line"]: full / r["file"] for r in manifest(full)}
    # Lines 1 and 13: the same prompt, seed and guidance, made in different batches (positions 0 and 5 of the
    # 7.5 group): the same pixels. Line 11 differs from them by its guidance only: other pixels.
    np.testing.assert_array_equal(pixels(by_line[1]), pixels(by_line[13]))
    assert np.abs(pixels(by_line[1]).astype(int) - pixels(by_line[11])).max() > 3  # 10 on tiny-sd at 2 steps


@pytest.mark.parametrize("number", [2, 5])
def test_equals_sdflax_generate_with_the_same_settings(tmp, full, number):
    line = LINES[number - 1]
    out = tmp / f"generate-{number}.png"
    done = run(tmp, [sys.executable, "-m", "sdflax", "generate", line["prompt"], *SIZE, "--num-images", "1",
                     "--seed", str(line.get("seed", SEED + number - 1)), "--guidance", str(line.get("guidance", 7.5)),
                     "--negative-prompt", line.get("negative_prompt", ""), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    made = next(r["file"] for r in manifest(full) if r["line"] == number)
    np.testing.assert_array_equal(pixels(full / made), pixels(out))


def wait_for_records(process, folder, count):
    while len(manifest(folder)) < count:
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)


def check_whole(folder):
    for name in pngs(folder):
        with Image.open(folder / name) as image:
            image.load()  # a cut PNG fails here


def stopped_at(how, image, tmp, out, progress=False):
    """The batch command of `out`, stopped at a known point by tests/batch_stop_worker.py (`how`, `image`): the
    same point on any machine, however slow or busy, where a signal sent on seeing a record could come after the
    last batch. `progress`: without --no-progress, so that the run says what it is doing."""
    worker = [sys.executable, str(ROOT / "tests" / "batch_stop_worker.py"), how, str(image)]
    args = [arg for arg in command(tmp, out)[3:] if not progress or arg != "--no-progress"]
    return subprocess.Popen(worker + args, cwd=tmp, env=env_for(tmp, 2), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_killed_runs_go_on_where_they_stopped_without_redoing_an_image(tmp, full):
    out = tmp / "resumed"
    # SIGKILL as the fourth image's PNG is in place: whole PNGs, each listed but the one in hand (written, not yet
    # listed: the next run adopts it, its text chunks saying it is this command's image of its line).
    killed = stopped_at("kill", 4, tmp, out)
    killed.communicate(timeout=600)
    assert killed.returncode == -signal.SIGKILL
    check_whole(out)
    listed = [r["file"] for r in manifest(out)]
    assert len(listed) == 3 and len(set(listed)) == len(listed)
    assert set(listed) <= set(pngs(out)) and len(set(pngs(out)) - set(listed)) == 1
    before = {name: os.stat(out / name).st_mtime_ns for name in pngs(out)}

    # SIGTERM mid-run: the image in hand is finished, exit 143, the manifest lists exactly the PNGs.
    stopped = stopped_at("wait", 1, tmp, out)  # after its first batch, the writer waits for the signal
    wait_for_records(stopped, out, len(before) + 1)
    stopped.send_signal(signal.SIGTERM)
    _, stderr = stopped.communicate(timeout=120)
    assert stopped.returncode == 143, stderr
    assert "stopped by SIGTERM after" in stderr.splitlines()[-1] and "run the same command again" in stderr
    check_whole(out)
    assert sorted(r["file"] for r in manifest(out)) == pngs(out) and len(pngs(out)) < 12

    done = run(tmp, command(tmp, out))
    assert done.returncode == 0, done.stderr
    records = manifest(out)
    assert sorted(r["line"] for r in records) == NUMBERS  # each line once: none made twice
    assert pngs(out) == pngs(full) == sorted(r["file"] for r in records)
    assert {name: os.stat(out / name).st_mtime_ns for name in before} == before  # nothing rewritten
    for name in pngs(out):
        np.testing.assert_array_equal(pixels(out / name), pixels(full / name))
    again = run(tmp, command(tmp, out))  # all done: nothing to load
    assert again.returncode == 0 and "all 12 images are in" in again.stderr and len(manifest(out)) == 12

    # a listed PNG moved away is made again (the rerun said "all 12 images are in" before), and only it
    moved = pngs(out)[4]
    os.rename(out / moved, tmp / moved)
    remade = run(tmp, command(tmp, out))
    assert remade.returncode == 0, remade.stderr
    assert pngs(out) == pngs(full) and [r["file"] for r in manifest(out)[12:]] == [moved]
    np.testing.assert_array_equal(pixels(out / moved), pixels(full / moved))
    assert {name: os.stat(out / name).st_mtime_ns for name in before if name != moved} == \
        {name: t for name, t in before.items() if name != moved}


def test_sigint_while_loading_exits_130_having_written_nothing(tmp):
    out = tmp / "interrupted"
    # the run waits, its models loaded, for the signal: on a busy machine it could otherwise make an image first
    interrupted = stopped_at("load", 0, tmp, out, progress=True)
    while not interrupted.stderr.readline().startswith("Loading "):  # (past any warning of JAX's)
        assert interrupted.poll() is None
    interrupted.send_signal(signal.SIGINT)
    _, stderr = interrupted.communicate(timeout=120)
    assert interrupted.returncode == 130, stderr
    assert stderr.splitlines()[-1] == (f"sdflax: stopped by SIGINT after 0 of 12 images; the manifest in {out} lists "
                                       "every image written: run the same command again to make the rest")
    assert pngs(out) == [] and manifest(out) == []


def test_sigterm_while_the_prompt_file_blocks_ends_the_run(tmp_path):
    """PROMPTS a FIFO that nobody writes: the run blocked reading it, and its SIGTERM handler, already installed,
    swallowed the signal (still running minutes later). Before the run begins a signal ends it as any process."""
    fifo = tmp_path / "prompts.txt"
    os.mkfifo(fifo)
    blocked = subprocess.Popen([sys.executable, "-m", "sdflax", "batch", str(fifo), "--out", str(tmp_path / "out"),
                                *SIZE], cwd=tmp_path, env=env_for(tmp_path, 1), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    while True:  # a writer's open succeeds once the run has the FIFO open for reading: it then waits in read()
        assert blocked.poll() is None
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            time.sleep(0.05)
    try:
        blocked.send_signal(signal.SIGTERM)
        blocked.communicate(timeout=60)
    finally:
        os.close(writer)
        blocked.kill()
    assert blocked.returncode == -signal.SIGTERM
    assert not (tmp_path / "out").exists()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_port():
    """A free port where jax.distributed's SLURM detection puts the coordinator: 61440 + job id % 4096 (above
    Linux's range of ports handed out by bind(0))."""
    for port in random.Random().sample(range(61440, 65536), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port in 61440-65535")


@pytest.mark.parametrize("join", ["flags", "slurm"])
def test_two_processes_split_the_prompts_and_make_the_same_images(tmp, full, join):
    """Two processes of 2 CPU devices each on one global mesh, jax.distributed over localhost: joined by
    --coordinator/--num-processes/--process-id, or detected from the environment of a 2-task SLURM step."""
    out, port = tmp / f"hosts-{join}", slurm_port()

    def start(i):
        env = env_for(tmp, 2)
        if join == "slurm":
            env.update(SLURM_JOB_ID=str(port - 61440), SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
                       SLURM_PROCID=str(i), SLURM_LOCALID=str(i))
            flags = []
        else:
            flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        return subprocess.Popen(command(tmp, out, *flags), cwd=tmp, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    processes = [start(i) for i in range(2)]
    try:
        results = [p.communicate(timeout=900) for p in processes]  # a hang guard, no deadline
    finally:
        for p in processes:  # one that failed leaves the other waiting for its part of a batch
            if p.poll() is None:
                p.kill()
    for p, (_, stderr) in zip(processes, results):
        assert p.returncode == 0, stderr
    per_process = [manifest(out, f"manifest.{i}.jsonl") for i in range(2)]
    lines = [[r["line"] for r in records] for records in per_process]
    assert all(lines) and not set(lines[0]) & set(lines[1])  # both worked, no image made twice
    assert sorted(lines[0] + lines[1]) == NUMBERS and not (out / "manifest.jsonl").exists()
    assert all(r["process"] == i for i, records in enumerate(per_process) for r in records)
    assert pngs(out) == pngs(full)
    for name in pngs(out):
        np.testing.assert_array_equal(pixels(out / name), pixels(full / name))


def test_a_file_that_is_not_this_commands_image_is_never_overwritten(tmp):
    out = tmp / "taken"
    out.mkdir()
    (out / "000003-a-green-tree.png").write_text("mine")
    done = run(tmp, command(tmp, out))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"sdflax: error: --out {out}: 000003-a-green-tree.png exists and is not this "
                                        "command's image of line 3: sdflax never overwrites a file; move it, or "
                                        "choose another --out"]
    assert (out / "000003-a-green-tree.png").read_text() == "mine" and pngs(out) == ["000003-a-green-tree.png"]


@pytest.mark.parametrize("flags, setting, theirs, ours", [
    (["--scheduler", "euler"], "sampler", "PLMS", "Euler"),  # tiny-sd's PNDM is A1111's PLMS
    (["--dtype", "bfloat16"], "dtype", "float32", "bfloat16"),
    (["--lora", "x.safetensors:0.5"], "lora", "none", '["x.safetensors"]'),
    (["--embedding", "x.pt"], "embedding", "none", '["x.pt"]'),
    (["--steps", "3"], "steps", "2", "3"),
    (["--guider", "apg"], "guider", "none", "AdaptiveProjectedGuidance")])  # resumed with another guider: mixed
def test_a_rerun_with_other_settings_is_refused_naming_the_setting(tmp, full, tmp_path, monkeypatch, capsys, flags,
                                                                   setting, theirs, ours):
    """A rerun went on in the folder with another --scheduler, --dtype, --lora or --embedding, mixing images of two
    settings; the same scheduler under another name (A1111's) is this command's: nothing to make."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(full, out)
    monkeypatch.chdir(tmp_path)
    for name in ("x.safetensors", "x.pt"):  # checked to be there; never read: the settings differ first
        (tmp_path / name).write_text("")
    args = command(tmp, out, *flags, "--num-processes", "1")[3:]  # the full run's, then the flags that change it
    assert main(args) == 2
    first = manifest(out)[0]
    assert capsys.readouterr().err == (f"sdflax: error: --out {out} holds {first['file']} of line {first['line']} made "
                                       f"with {setting} {theirs}, not {ours}: use another --out for other settings\n")
    assert main(command(tmp, out, "--scheduler", "PLMS", "--num-processes", "1")[3:]) == 0, capsys.readouterr().err
    assert "all 12 images are in" in capsys.readouterr().err and len(manifest(out)) == 12


def test_pngs_of_a_batch_with_a_lora_say_so_and_a_rerun_with_another_scale_is_refused(tmp, full):
    """PNGs of `batch --lora` carried no `lora` text chunks and no <lora:...> in `parameters` (generate's do)."""
    from test_cli_lora import torch_tiny
    from test_lora import kohya_file

    kohya_file(tmp / "fox.safetensors", torch_tiny(), seed=1)
    (tmp / "fox.txt").write_text("a red fox\n")
    out = tmp / "lora"
    args = [sys.executable, "-m", "sdflax", "batch", "fox.txt", "--out", str(out), *SIZE, "--seed", "7",
            "--batch-per-device", "2", "--lora", "fox.safetensors:0.7"]
    done = run(tmp, args)
    assert done.returncode == 0, done.stderr
    with Image.open(out / "000001-a-red-fox.png") as image:
        text = dict(image.text)
    assert (text["lora"], text["lora_scale"]) == ('["fox.safetensors"]', "[0.7]")
    assert text["parameters"].startswith("a red fox <lora:fox:0.7>\nSteps: 2,")
    # line 1 of the full run: the same prompt, seed and guidance without the LoRA
    assert np.abs(pixels(out / "000001-a-red-fox.png").astype(int) - pixels(full / "000001-a-red-fox.png")).max() > 3
    again = run(tmp, args[:-1] + ["fox.safetensors:0.5"])
    assert again.returncode == 2
    assert again.stderr.splitlines() == [f"sdflax: error: --out {out} holds 000001-a-red-fox.png of line 1 made with "
                                         "lora_scale [0.7], not [0.5]: use another --out for other settings"]


# ---- prompt files and bad input (in process: they fail before JAX starts) -----------------------------------

RECORD = '{"line": 1, "file": "000001-a-fox.png", "seed": 3, "settings": {}, "process": 0, "batch_seed": 3}'


@pytest.mark.parametrize("text, line", [("my notes\nmore notes\n", 1),
                                        ("my notes", 1),  # no newline at the end: not a record cut short
                                        (f"{RECORD}\nmy notes", 2),
                                        (f"{RECORD}\n{{\"notes\": 1", 2),
                                        # records of the wrong types were tracebacks
                                        (RECORD.replace('"settings": {}', '"settings": null'), 1),
                                        (RECORD.replace('"batch_seed": 3', '"batch_seed": "abc"'), 1),
                                        (RECORD.replace('"seed": 3', '"seed": ' + "9" * 5000), 1),
                                        ("[" * 100000 + "\n", 1)])
def test_a_manifest_that_is_not_sdflaxs_is_never_written_to(tmp_path, capsys, text, line):
    (tmp_path / "prompts.txt").write_text("a fox\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.jsonl").write_text(text)
    assert main(["batch", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "out"), "--model", TINY]) == 2
    assert capsys.readouterr().err == (f"sdflax: error: {tmp_path / 'out' / 'manifest.jsonl'} is not a manifest of "
                                       f"sdflax batch (line {line}): sdflax never overwrites a file; move it, or "
                                       "choose another --out\n")
    assert (tmp_path / "out" / "manifest.jsonl").read_text() == text


def test_a_manifest_that_is_a_folder_is_refused(tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("a fox\n")
    (tmp_path / "out" / "manifest.jsonl").mkdir(parents=True)
    assert main(["batch", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "out"), "--model", TINY]) == 2
    assert capsys.readouterr().err == (f"sdflax: error: {tmp_path / 'out' / 'manifest.jsonl'} is not a manifest of "
                                       "sdflax batch (not a file): sdflax never overwrites a file; move it, or choose "
                                       "another --out\n")


def test_only_a_record_of_ours_cut_short_counts_as_a_kill(tmp_path):
    from sdflax.cli.manifest import read_manifests

    for cut in ('{"li', '{"line": 2, "file": "000002-a-f'):
        (tmp_path / "manifest.jsonl").write_text(f"{RECORD}\n{cut}")
        assert read_manifests(tmp_path) == [json.loads(RECORD)]


def test_two_runs_on_one_out_do_not_race_the_second_is_refused_naming_the_first(tmp_path, capsys):
    """Two runs on one --out raced: one died with FileNotFoundError, the manifest listed images twice."""
    import fcntl

    (tmp_path / "prompts.txt").write_text("a fox\n")
    (tmp_path / "out").mkdir()
    lock = tmp_path / "out" / ".sdflax-batch.0.lock"
    lock.write_text("process 4242 on otherhost")
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a run in progress holds it
        assert main(["batch", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "out"), *SIZE,
                     "--num-processes", "1"]) == 2
    assert capsys.readouterr().err == (f"sdflax: error: --out {tmp_path / 'out'} is in use by another sdflax batch "
                                       "(process 4242 on otherhost): wait for it to finish, or choose another --out\n")
    assert sorted(os.listdir(tmp_path / "out")) == [".sdflax-batch.0.lock"]


@pytest.mark.parametrize("name", [".sdflax-batch.0.lock", "manifest.jsonl"])
def test_a_symbolic_link_in_out_is_never_written_through(tmp_path, capsys, name):
    """A lock file or a manifest linked to a file out of --out: the run truncated and overwrote the lock's target,
    and would have appended to the manifest's."""
    (tmp_path / "prompts.txt").write_text("a fox\n")
    (tmp_path / "out").mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("")  # empty: a manifest without records, as far as reading it goes
    (tmp_path / "out" / name).symlink_to(notes)
    assert main(["batch", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "out"), *SIZE,
                 "--num-processes", "1"]) == 2
    assert capsys.readouterr().err == (f"sdflax: error: {tmp_path / 'out' / name} is a symbolic link: sdflax never "
                                       "writes through one (it may point out of --out); remove it, or choose "
                                       "another --out\n")
    assert notes.read_text() == ""


def test_a_png_is_never_written_through_a_link_at_its_temporary_name(tmp_path):
    from PIL import Image

    from sdflax.cli.manifest import link_png, temporary

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    os.symlink(notes, temporary(tmp_path, "000001-a-fox.png", 0))
    link_png(str(tmp_path), "000001-a-fox.png", Image.new("RGB", (4, 4), "red"), None, 0)
    assert notes.read_text() == "my notes\n"
    assert sorted(os.listdir(tmp_path)) == ["000001-a-fox.png", "notes.txt"]
    with Image.open(tmp_path / "000001-a-fox.png") as image:
        assert image.getpixel((0, 0)) == (255, 0, 0)


def test_a_manifest_it_cannot_write_is_one_line(tmp_path, capsys, monkeypatch):
    """A manifest of another user's (or a read-only folder) was a PermissionError traceback."""
    import sdflax.cli.manifest

    real_open = os.open

    def refusing_open(path, flags, *args):
        if str(path).endswith("manifest.jsonl") and flags & os.O_APPEND:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(sdflax.cli.manifest.os, "open", refusing_open)
    (tmp_path / "prompts.txt").write_text("a fox\n")
    assert main(["batch", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "out"), *SIZE,
                 "--num-processes", "1"]) == 2
    assert capsys.readouterr().err == (f"sdflax: error: {tmp_path / 'out' / 'manifest.jsonl'}: cannot write to it "
                                       "(Permission denied): choose another --out\n")


@pytest.mark.parametrize("failing", ["png", "manifest"])
def test_a_full_disk_stops_the_run_in_one_line_keeping_what_was_written(tmp_path, monkeypatch, failing):
    """A full disk mid-run was an OSError traceback from the writer thread."""
    import errno
    import threading

    import sdflax.cli.workers
    from sdflax.cli.manifest import Manifest
    from sdflax.cli.request import UserError
    from sdflax.cli.workers import Writer

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "png":
        monkeypatch.setattr(sdflax.cli.workers, "link_png", full)
    else:
        monkeypatch.setattr(Manifest, "append", lambda self, record: full())
    settings = {"prompt": "a fox", "negative_prompt": "", "steps": 2, "sampler": "Euler", "scheduler": "euler",
                "guidance_scale": 7.5, "width": 8, "height": 8, "model": "m", "seed": 1}
    writer = Writer(str(tmp_path), Manifest(str(tmp_path / "manifest.jsonl")), 0, 3, lambda message: None,
                    lambda line: settings, 1, lambda images: [Image.new("RGB", (8, 8))] * len(images),
                    threading.Event())
    lines = [Line(n, "a fox", "", None, None, 2, 8, 8) for n in (1, 2)]
    with pytest.raises(UserError) as info:
        writer.write(lines, [None, None])
    assert str(info.value) == (f"cannot write 000001-a-fox.png in {tmp_path} (No space left on device) after 0 of 3 "
                               "images: make room and run the same command again to make the rest")


def test_a_text_file_is_one_prompt_a_line_and_blank_lines_keep_their_number(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red fox, watercolor\n\n  {not json}  \n")
    args = main_args()
    # steps: the line's or --steps, else None: the pipeline's default, once the checkpoint is known
    assert read_prompts(str(path), args) == [Line(1, "a red fox, watercolor", "", None, None, None, None, None),
                                             Line(3, "{not json}", "", None, None, None, None, None)]
    assert read_prompts(str(path), args)[0].name == "000001-a-red-fox-watercolor.png"


def test_lines_end_at_newlines_only(tmp_path):
    """Form feeds, U+2028 and U+0085 inside a line made three images of two lines and shifted later seeds; so did
    a lone carriage return, which Python's universal newlines read as a line end."""
    path = tmp_path / "prompts.txt"
    path.write_text("a fox\u2028in snow\r\na cat\x0cby\u0085night\n\ra dog\rat dawn\n", encoding="utf-8")
    assert [(line.number, line.prompt) for line in read_prompts(str(path), main_args())] == [
        (1, "a fox\u2028in snow"), (2, "a cat\x0cby\u0085night"), (3, "a dog\rat dawn")]


def test_prompt_files_and_lines_are_bounded(tmp_path, monkeypatch):
    from sdflax.cli import batch
    from sdflax.cli.request import UserError

    path = tmp_path / "prompts.txt"
    path.write_text("a fox\n" + "x" * (batch.MAX_LINE_CHARS + 1) + "\n")
    with pytest.raises(UserError, match=rf"prompts.txt line 2: {batch.MAX_LINE_CHARS + 1} characters, over "
                                        rf"{batch.MAX_LINE_CHARS}: a prompt is 77 tokens"):
        read_prompts(str(path), main_args())
    monkeypatch.setattr(batch, "MAX_PROMPTS_BYTES", 2**20)
    with pytest.raises(UserError, match="PROMPTS /dev/zero is over 1 MiB: split it into several files"):
        read_prompts("/dev/zero", main_args())  # grew until killed


def main_args():
    from sdflax.cli.batch import add_command
    from sdflax.cli import build_parser

    return build_parser(add_command).parse_args(["batch", "p.txt", "--out", "x"])


@pytest.mark.parametrize("lines, message", [
    (None, "PROMPTS {p}: cannot read it (No such file or directory): give a text file, one prompt a line, or .jsonl"),
    (['{"prompt": "a fox"}', '{"prompt": "a cat",}'], "PROMPTS {p} line 2: not JSON (* at column *): write one "
     'object a line, e.g. {{"prompt": "a red fox", "seed": 3}}'),  # (the JSON reason is Python's)
    (['{"prompt": "a fox", "seed": ' + "9" * 5000 + "}"], "PROMPTS {p} line 1: not JSON sdflax reads (a number "
     "of thousands of digits, or nesting thousands deep): write one flat object a line, e.g. *"),
    (["[" * 10000], "PROMPTS {p} line 1: not JSON sdflax reads (*"),
    (['{"prompt": "a fox", "cfg": 3}'], "PROMPTS {p} line 1: unknown key 'cfg': a line may set prompt, "
     "negative_prompt, seed, guidance, steps, width, height"),
    (["", '{"prompt": "a fox", "seed": -1}'], "PROMPTS {p} line 2: seed must be between 0 and 4294967295, got -1"),
    (['{"prompt": "a fox", "steps": 2.5}'], "PROMPTS {p} line 1: steps must be a whole number, got 2.5"),
    (['{"negative_prompt": "x"}'], 'PROMPTS {p} line 1: no "prompt": every line needs one'),
    ([""], 'PROMPTS {p} holds no prompt: write one prompt a line, or one {{"prompt": ...}} object a line'),
])
def test_bad_prompt_files_are_one_line_naming_the_line(tmp_path, capsys, lines, message):
    path = tmp_path / "prompts.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines) + "\n")
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--model", TINY]) == 2
    assert fnmatch.fnmatchcase(capsys.readouterr().err, f"sdflax: error: {message.format(p=path)}\n")
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("a fox\n")
    (tmp_path / "out").write_text("")
    assert main(["batch", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "out"), "--model", TINY]) == 2
    assert capsys.readouterr().err == (f"sdflax: error: --out {tmp_path / 'out'} is a file: give a folder (sdflax "
                                       "batch writes one PNG a prompt and its manifest there)\n")


def test_a_size_a_line_asks_for_is_checked_against_the_model_and_names_the_line(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a fox"}\n{"prompt": "a cat", "width": 30}\n')
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--model", TINY, "--num-processes", "1"]) == 2
    assert capsys.readouterr().err == (f"sdflax: error: PROMPTS {path} line 2: --width 30 is not a multiple of 4, "
                                       f"the VAE scale factor of {TINY}: use 28 or 32\n")


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "127.0.0.1:1"], "give --coordinator HOST:PORT, --num-processes N and --process-id I together"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],  # a traceback from jax before
     "argument --coordinator: expected HOST:PORT, e.g. 10.0.0.1:1234, got 'localhost'"),
    (["--grid"], "unrecognized arguments: --grid"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, flags, message):
    (tmp_path / "prompts.txt").write_text("a fox\n")
    assert main(["batch", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "out"), "--model", TINY,
                 *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_benchmark_batch_mode_reports_both_rates(tmp, full):
    """scripts/benchmark.py --batch-prompts: `sdflax batch` and a loop of pipeline(...) calls, fresh processes."""
    done = run(tmp, [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--model", TINY, "--steps", "2",
                     "--height", "32", "--width", "32", "--batch-prompts", "6", "--batch", "2",
                     "--cache-dir", str(tmp / "jax-cache")])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["prompts"] == 6 and out["devices"] == 2 and out["batch_per_device"] == 2
    for mode in ("batch", "loop"):
        assert out[mode]["wall_s"] > 0 and out[mode]["images_per_s"] == pytest.approx(6 / out[mode]["wall_s"])
        assert out[mode]["steady_images_per_s"] > 0
    assert out["ratio"]["images_per_s"] == pytest.approx(out["batch"]["images_per_s"] / out["loop"]["images_per_s"])
