"""`sdflax batch PROMPTS --out DIR`: one PNG per prompt line, on every device of every process, resumable.

Line n of PROMPTS (counted from 1) becomes `DIR/<n, 6 digits>-<slug>.png`, made with seed S + n - 1 (or its own),
so an image is the same whatever the batch, device or process count, and equals `sdflax generate` with that
seed. Each PNG is written under a temporary name and linked into place (never over a file), then one record is
appended to the process's manifest and fsynced: a run killed at any moment leaves whole PNGs and a manifest that
lists them, and the same command run again makes only the rest. Several processes (`jax.distributed`) split
the prompts over one global device mesh; each writes its own devices' images and its own manifest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import re
import signal
import sys
import threading
import time
import zlib

from . import cli
from .cli import UserError

KEYS = ("prompt", "negative_prompt", "seed", "guidance", "steps", "width", "height")  # what a JSONL line may set
# A line's own values are checked with the command line's parsers, so that both refuse the same values.
CHECKS = {"seed": cli._seed, "guidance": cli._finite, "steps": cli._positive_int, "width": cli._positive_int,
          "height": cli._positive_int}
# The settings that make an image: a manifest record or a PNG made with others is not this command's image.
SAME = ("prompt", "negative_prompt", "seed", "steps", "guidance_scale", "width", "height", "model")
MANIFEST = re.compile(r"manifest(\.\d+)?\.jsonl")


def add_command(commands):
    b = commands.add_parser("batch", help="a file of prompts -> one PNG each, resumable, on many devices and hosts",
                            description="Make one PNG per line of PROMPTS (a text file, one prompt a line, or .jsonl "
                            "with per-line prompt, negative_prompt, seed, guidance, steps, width, height) in --out, "
                            "with DIR/manifest.jsonl listing them. Line n uses seed S + n - 1 unless it sets its "
                            "own. Run the same command again to finish an interrupted run: done images are "
                            "skipped. Several processes (--coordinator, or as jax.distributed detects them on TPU, "
                            "SLURM, Kubernetes) split the prompts over all their devices.")
    b.add_argument("prompts", metavar="PROMPTS", help="text file (one prompt a line) or .jsonl (one object a line)")
    cli._add_options(b, exclude=("--num-images", "--grid", "--controlnet", "--control-image", "--control-scale",
                                 "--out"))
    b.add_argument("--out", required=True, metavar="DIR", help="the folder for the PNGs and the manifest")
    b.add_argument("--batch-per-device", type=cli._positive_int, default=1, metavar="N",
                   help="images each device makes at once (default: 1)")
    b.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, to join several processes "
                   "(default: as jax.distributed detects a TPU slice, SLURM or Kubernetes job; else one process)")
    b.add_argument("--num-processes", type=cli._positive_int, metavar="N", help="with --coordinator; 1 alone: this "
                   "process only, even inside a cluster job")
    b.add_argument("--process-id", type=int, metavar="I", help="with --coordinator: this process, 0 .. N-1")
    b.set_defaults(run=run)


@dataclasses.dataclass(frozen=True)
class Line:
    number: int  # in the file, from 1
    prompt: str
    negative_prompt: str
    seed: int | None  # its own, else the command's S + number - 1
    guidance: float | None
    steps: int
    height: int | None
    width: int | None

    @property
    def name(self):
        return f"{self.number:06d}-{cli.slug(self.prompt)}.png"


def read_prompts(path, args) -> list[Line]:
    """The prompt lines, each checked; a mistake names the line. Blank lines are skipped (and keep their number)."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror or e
        raise UserError(f"PROMPTS {path}: cannot read it ({reason}): give a text file, one prompt a line, or "
                        ".jsonl") from e
    jsonl = path.lower().endswith(".jsonl")
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        values = _json_line(path, number, raw) if jsonl else {"prompt": raw.strip()}
        lines.append(Line(number, values["prompt"], values.get("negative_prompt", args.negative_prompt),
                          values.get("seed"), values.get("guidance", args.guidance), values.get("steps", args.steps),
                          values.get("height", args.height), values.get("width", args.width)))
    if not lines:
        raise UserError(f"PROMPTS {path} holds no prompt: write one prompt a line"
                        + (', or one {"prompt": ...} object a line' if jsonl else ""))
    return lines


def _json_line(path, number, raw) -> dict:
    where = f"PROMPTS {path} line {number}"
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno}): write one object a line, e.g. "
                        '{"prompt": "a red fox", "seed": 3}') from None
    if not isinstance(values, dict):
        raise UserError(f'{where}: a JSON {type(values).__name__}, not an object: write {{"prompt": ...}}')
    unknown = [key for key in values if key not in KEYS]
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}: a line may set {', '.join(KEYS)}")
    for key in ("prompt", "negative_prompt"):
        if key in values and not isinstance(values[key], str):
            raise UserError(f"{where}: {key} must be a string, got {json.dumps(values[key])}")
    if not values.get("prompt", "").strip():
        raise UserError(f'{where}: no "prompt": every line needs one')
    for key, check in CHECKS.items():
        value = values.get(key)
        if value is None:
            continue
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not (whole or (key == "guidance" and isinstance(value, float))):
            raise UserError(f"{where}: {key} must be a {'number' if key == 'guidance' else 'whole number'}, got "
                            f"{json.dumps(value)}")
        try:
            values[key] = check(str(value))
        except argparse.ArgumentTypeError as e:
            raise UserError(f"{where}: {key} {e}") from None
    return values


# ---- the command --------------------------------------------------------------------------------------------

def run(args) -> int:
    with _Signals() as signals:
        return _run(args, signals)


def _run(args, signals) -> int:
    status = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.progress is not False else (lambda m: 0)
    lines = read_prompts(args.prompts, args)  # every mistake before JAX starts
    folder = _output_folder(args.out)
    # The generate command's view of these arguments, for cli's checks and loaders.
    view = argparse.Namespace(**{**vars(args), "command": "generate", "controlnet": [], "control_image": [],
                                 "control_scale": [], "num_images": None, "grid": False, "prompt": lines[0].prompt})
    records = _read_manifests(folder)
    process, processes = _join_processes(args)  # before anything starts JAX's backend (the scheduler checks do)
    checkpoints = _check_lines(view, lines)

    import jax

    from .parallel import device_mesh, replicate_on

    cli._use_cache_dir(args)
    backend = jax.default_backend()
    dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    cli._check_attention(view, backend, dtype)

    base, seeds, manifest, todo = _resume(args, folder, lines, checkpoints, records, process, processes)
    if not todo:
        print(f"batch: all {len(lines)} images are in {args.out} already", file=sys.stderr)
        return 0

    mesh = device_mesh(jax.devices())
    status(f"Loading {args.model} in {dtype} ...")
    pipeline, params = cli._load(view, checkpoints[_program(todo[0])], dtype)
    params = replicate_on(params, mesh)  # once: every batch then finds them in place
    plan = _plan(todo, args.batch_per_device * mesh.size, checkpoints)
    mine = _own_rows(mesh, args.batch_per_device, process)
    total = sum(1 for _, rows in plan for r in mine if r < len(rows))
    where = f"{mesh.size} {backend.upper()} device" + ("s" if mesh.size > 1 else "") + (
        f" in {processes} processes" if processes > 1 else "")
    status(f"batch: {len(todo)} of {len(lines)} images to make ({len(lines) - len(todo)} done before), "
           f"{args.batch_per_device * mesh.size} at a time on {where}; this process writes {total}")

    def settings(line):
        checkpoint = dataclasses.replace(checkpoints[_program(line)], guidance=_guidance(line, checkpoints))
        line_view = argparse.Namespace(**{**vars(view), "prompt": line.prompt,
                                          "negative_prompt": line.negative_prompt, "steps": line.steps})
        return {**cli.image_settings(line_view, pipeline, checkpoint, dtype), "seed": seeds[line.number]}

    writer = _Writer(folder, manifest, process, total, status, settings, base, pipeline.numpy_to_pil, signals.stop)
    producer = _Producer(pipeline, params, mesh, plan, mine, args.batch_per_device * mesh.size, seeds, checkpoints,
                         writer, where)
    return _run_until_done_or_signal(producer, writer, signals, args.out, processes)


def _resume(args, folder, lines, checkpoints, records, process, processes):
    """(the command's seed S, each line's seed, this process's manifest, the lines still to make): what the
    manifests list is done, once checked to be this command's images, and a PNG a kill left unlisted is
    adopted."""
    base = _base_seed(args, records, processes)
    seeds = {line.number: (line.seed if line.seed is not None else (base + line.number - 1) % 2**32)
             for line in lines}
    keys = {line.number: _key(line, seeds[line.number], checkpoints[_program(line)], args.model) for line in lines}
    done = _check_records(records, lines, keys, args.out)
    manifest = _Manifest(os.path.join(folder, "manifest.jsonl" if processes == 1 else f"manifest.{process}.jsonl"))
    _remove_own_temporaries(folder, process)
    orphans = [line.number for line in lines if line.number not in done and _orphan(folder, line, keys, args.out)]
    done, adopt = _agree(lines, done, orphans, args.prompts, process, processes)
    for line in lines:
        if line.number in adopt:  # its settings as the PNG's text chunks hold them
            manifest.append(_record(line, base, keys[line.number], process,
                                    os.path.getmtime(os.path.join(folder, line.name))))
    return base, seeds, manifest, [line for line in lines if line.number not in done]


def _output_folder(out) -> str:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file: give a folder (sdflax batch writes one PNG a prompt and its "
                        "manifest there)")
    return cli._output_target(os.path.join(out, "")).folder  # made, and checked to be writable


def _program(line):
    """What fixes the compiled program (and cli's checks): steps and size."""
    return line.steps, line.height, line.width


def _guidance(line, checkpoints):
    return line.guidance if line.guidance is not None else checkpoints[_program(line)].guidance


def _check_lines(view, lines) -> dict:
    """cli's checks of steps and size against the checkpoint's configs, once per program; a refusal names the
    first line that asks for it."""
    checkpoints = {}
    for line in lines:
        if _program(line) in checkpoints:
            continue
        steps, height, width = _program(line)
        try:
            checkpoints[_program(line)] = cli._check_checkpoint(
                argparse.Namespace(**{**vars(view), "steps": steps, "height": height, "width": width}), {})
        except UserError as e:
            if _program(line) == (view.steps, view.height, view.width):
                raise  # the command line's values
            raise UserError(f"PROMPTS {view.prompts} line {line.number}: {e}") from e
    return checkpoints


def _key(line, seed, checkpoint, model) -> dict:
    """The settings that identify the image of a line (SAME), as the PNG's text chunks hold them."""
    values = {"prompt": line.prompt, "negative_prompt": line.negative_prompt, "seed": seed, "steps": line.steps,
              "guidance_scale": line.guidance if line.guidance is not None else checkpoint.guidance,
              "width": checkpoint.width, "height": checkpoint.height, "model": model}
    return {name: str(values[name]) for name in SAME}


def _join_processes(args) -> tuple[int, int]:
    """(this process, the process count): --coordinator, or whatever cluster jax.distributed detects, or one."""
    import jax

    explicit = (args.coordinator, args.num_processes, args.process_id)
    if explicit == (None, 1, None):  # this process alone, whatever cluster it runs in
        return 0, 1
    if any(value is not None for value in explicit):
        if any(value is None for value in explicit):
            raise UserError("give --coordinator HOST:PORT, --num-processes N and --process-id I together (or none: "
                            "jax.distributed then detects a TPU slice, SLURM or Kubernetes job)")
        if not 0 <= args.process_id < args.num_processes:
            raise UserError(f"--process-id {args.process_id}: give 0 to {args.num_processes - 1}")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    elif not jax.distributed.is_initialized():
        try:
            jax.distributed.initialize()
        except ValueError:  # no cluster detected: this process alone
            pass
    return jax.process_index(), jax.process_count()


def _base_seed(args, records, processes) -> int:
    """--seed, else the one an earlier run of this command chose (its manifest says), else random; one for all."""
    if args.seed is not None:
        return args.seed
    earlier = [r["batch_seed"] for r in records if "batch_seed" in r]
    seed = earlier[0] if earlier else int.from_bytes(os.urandom(4), "little") >> 1
    if processes > 1:
        from jax.experimental import multihost_utils

        seed = int(multihost_utils.broadcast_one_to_all(seed))
    return seed


def _check_records(records, lines, keys, out) -> set:
    """The lines the manifests list; a record of another line or other settings is another command's: refused."""
    numbers = {line.number for line in lines}
    done = set()
    for record in records:
        number = record.get("line")
        if number not in numbers:
            raise UserError(f"--out {out} holds {record.get('file')}, made for line {number}, which PROMPTS does not "
                            "have: use another --out for other prompts")
        made = {name: str(record.get("settings", {}).get(name)) for name in SAME}
        if made != keys[number]:
            name = next(name for name in SAME if made[name] != keys[number][name])
            raise UserError(f"--out {out} holds {record.get('file')} of line {number} made with {name} "
                            f"{made[name]}, not {keys[number][name]}: use another --out for other settings")
        done.add(number)
    return done


def _orphan(folder, line, keys, out) -> bool:
    """Whether the line's file exists though no manifest lists it: an image of this command written just before
    a kill (adopted), or someone else's file, which sdflax never overwrites (refused)."""
    path = os.path.join(folder, line.name)
    if not os.path.lexists(path):
        return False
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
            made = {name: image.text.get(name) for name in SAME}
    except Exception:  # noqa: BLE001 (any unreadable file is not ours)
        made = None
    if made != keys[line.number]:
        raise UserError(f"--out {out}: {line.name} exists and is not this command's image of line {line.number}: "
                        "sdflax never overwrites a file; move it, or choose another --out")
    return True


def _agree(lines, done, orphans, prompts, process, processes):
    """(the lines done, the orphans this process adopts): every process must plan the same batches, whether the
    processes share one folder or each has its own disk, so what each one found is gathered."""
    if processes == 1:
        return done | set(orphans), orphans
    import numpy as np
    from jax.experimental import multihost_utils

    with open(os.path.expanduser(prompts), "rb") as f:
        crc = zlib.crc32(f.read())
    numbers = [line.number for line in lines]
    mine = np.array([crc & 0x7FFFFFFF] + [2 * (n in done) + (n in orphans) for n in numbers], np.int32)
    seen = np.asarray(multihost_utils.process_allgather(mine))  # (processes, 1 + lines)
    if (seen[:, 0] != seen[0, 0]).any():
        raise UserError(f"PROMPTS {prompts} differs between the processes: give every process the same file")
    listed = (seen[:, 1:] >= 2).any(0)
    found = (seen[:, 1:] % 2).astype(bool)
    first_finder = np.where(found.any(0), found.argmax(0), -1)
    adopt = [n for n, lst, f in zip(numbers, listed, first_finder) if not lst and f == process]
    all_done = {n for n, lst, f in zip(numbers, listed, first_finder) if lst or f >= 0}
    return all_done, adopt


def _plan(todo, batch, checkpoints) -> list:
    """[(program, lines)]: batches of `batch` lines, each of one compiled program and one guidance scale (the
    pipeline takes one scale per call, traced: a new scale does not recompile), in the order of the file."""
    groups = {}
    for line in todo:
        # SDXL's unconditional input is zeros without a negative prompt, the empty prompt's encoding with one
        zeros = checkpoints[_program(line)].xl and not line.negative_prompt
        groups.setdefault((_program(line), _guidance(line, checkpoints), zeros), []).append(line)
    return [(key, lines[i:i + batch]) for key, lines in groups.items() for i in range(0, len(lines), batch)]


def _own_rows(mesh, per_device, process) -> list[int]:
    """The rows of a batch that this process's devices make, in the mesh's order (generate_sharded's)."""
    return [row for row in range(per_device * mesh.size)
            if mesh.devices.flat[row // per_device].process_index == process]


# ---- files --------------------------------------------------------------------------------------------------

def _read_manifests(folder) -> list[dict]:
    """The records of every process's manifest; a last line cut short by a kill is not a record."""
    records = []
    for name in sorted(os.listdir(folder)):
        if not MANIFEST.fullmatch(name):
            continue
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            texts = f.read().split("\n")
        for i, text in enumerate(texts):
            try:
                record = json.loads(text) if text.strip() else None
            except json.JSONDecodeError:
                if i == len(texts) - 1:
                    continue  # cut short by a kill
                record = "not JSON"
            if record is not None and not (isinstance(record, dict) and isinstance(record.get("line"), int)):
                raise UserError(f"{os.path.join(folder, name)} is not a manifest of sdflax batch (line {i + 1}): "
                                "sdflax never overwrites a file; move it, or choose another --out")
            if record is not None:
                records.append(record)
    return records


def _record(line, base, settings, process, made) -> dict:
    """`batch_seed`: the command's S, so that a run without --seed goes on with the seed the first one drew."""
    return {"line": line.number, "file": line.name, "seed": int(settings["seed"]), "settings": settings,
            "process": process, "batch_seed": base, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(made))}


class _Manifest:
    """This process's manifest: one JSON line per image, appended in one write and fsynced."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        size = os.fstat(self.fd).st_size
        if size and os.pread(self.fd, 1, size - 1) != b"\n":  # a line cut short by a kill: not a record
            with open(path, "rb") as f:
                keep = f.read().rfind(b"\n") + 1
            os.ftruncate(self.fd, keep)

    def append(self, record):
        os.write(self.fd, (json.dumps(record, ensure_ascii=False) + "\n").encode())
        os.fsync(self.fd)


def _temporary(folder, name, process):
    return os.path.join(folder, f".{name}.{process}.tmp")


def _remove_own_temporaries(folder, process):
    """A kill leaves at most one half-written temporary file of this process's: not an image, removed."""
    pattern = re.compile(rf"\.\d{{6,}}-.*\.png\.{process}\.tmp")
    for name in os.listdir(folder):
        if pattern.fullmatch(name):
            os.unlink(os.path.join(folder, name))


def _write_png(folder, name, image, info, process):
    """Write the PNG whole under a temporary name, then link it into place: the name never holds a partial
    image, and a file that took the name meanwhile is never replaced."""
    temporary, path = _temporary(folder, name, process), os.path.join(folder, name)
    try:
        with open(temporary, "wb") as f:
            image.save(f, format="PNG", pnginfo=info)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links
            if os.path.lexists(path):
                raise FileExistsError(path) from None
            os.rename(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the name, before the manifest lists it
    finally:
        os.close(directory)


# ---- running ------------------------------------------------------------------------------------------------

class _Writer:
    """A thread that turns finished batches into PNGs and manifest records while the devices make the next one;
    after a signal it finishes the image in hand and stops."""

    def __init__(self, folder, manifest, process, total, status, settings, base, to_pil, stop):
        self.folder, self.manifest, self.process, self.total, self.status = folder, manifest, process, total, status
        self.settings, self.base, self.to_pil = settings, base, to_pil
        self.jobs = queue.Queue(maxsize=1)  # one batch waiting while the next is made
        self.stop, self.error, self.written = stop, None, 0
        self.first = None  # (time, count) when the first batch was written: the rate leaves compiling out
        self.thread = threading.Thread(target=self._loop, name="sdflax-batch-writer", daemon=True)

    def _loop(self):
        try:
            while not self.stop.is_set():
                try:
                    job = self.jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                if job is None:
                    return
                self._write(*job)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread)
            self.error = e
            self.stop.set()

    def _write(self, lines, images):
        from .cli import png_info

        if not lines:  # a batch of other processes' rows only
            return
        for line, image in zip(lines, self.to_pil(images)):
            if self.stop.is_set():
                return
            settings = self.settings(line)
            try:
                _write_png(self.folder, line.name, image, png_info(settings), self.process)
            except FileExistsError as e:
                raise UserError(f"{line.name} exists now in {self.folder}: sdflax never overwrites a file; move "
                                "it and run the command again") from e
            self.manifest.append(_record(line, self.base, settings, self.process, time.time()))
            self.written += 1
        self._progress()

    def _progress(self):
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, self.written)
            rate = ""
        else:
            per_s = (self.written - self.first[1]) / max(now - self.first[0], 1e-9)
            left = (self.total - self.written) / per_s if per_s else 0
            rate = f", {per_s:.2f} images/s, ETA {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"
        self.status(f"batch: {self.written}/{self.total} images{rate}")


class _Producer:
    """A thread that runs the plan's batches on the mesh and hands this process's rows to the writer."""

    def __init__(self, pipeline, params, mesh, plan, mine, batch, seeds, checkpoints, writer, where):
        self.pipeline, self.params, self.mesh, self.plan, self.mine, self.batch = pipeline, params, mesh, plan, mine, \
            batch
        self.seeds, self.checkpoints, self.writer, self.where = seeds, checkpoints, writer, where
        self.error = None
        self.thread = threading.Thread(target=self._loop, name="sdflax-batch-producer", daemon=True)

    def _loop(self):
        try:
            for (program, guidance, _), lines in self.plan:
                if self.writer.stop.is_set():
                    return
                images = self._make(program, guidance, lines)
                own = [(lines[row], image) for row, image in zip(self.mine, images) if row < len(lines)]
                job = ([line for line, _ in own], [image for _, image in own])
                while not self.writer.stop.is_set():
                    try:
                        self.writer.jobs.put(job, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            self.writer.jobs.put(None)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread)
            self.error = e
            self.writer.stop.set()

    def _make(self, program, guidance, lines):
        """This process's images of one batch, (own rows, H, W, 3); the batch is padded with its last line."""
        import jax
        import numpy as np

        batch = self.batch
        rows = lines + [lines[-1]] * (batch - len(lines))
        checkpoint = self.checkpoints[program]
        ids = self.pipeline.prepare_inputs([line.prompt for line in rows])
        neg_empty = checkpoint.xl and not any(line.negative_prompt for line in rows)
        # SD: the empty prompt's ids are its unconditional ones; SDXL: zeros for no negative prompt (as generate)
        neg = None if neg_empty else self.pipeline.prepare_inputs([line.negative_prompt for line in rows])
        keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(self.seeds[line.number]))) for line in rows])
        try:
            return self.pipeline.generate_sharded(ids, self.params, keys, num_inference_steps=program[0],
                                                  height=checkpoint.height, width=checkpoint.width,
                                                  guidance_scale=guidance, neg_prompt_ids=neg, mesh=self.mesh)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise UserError(f"out of memory making {batch} images of {checkpoint.width}x{checkpoint.height} on "
                            f"{self.where}: use a smaller --batch-per-device or --dtype bfloat16") from None


def _exit(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Signals:
    """While a batch runs, SIGINT and SIGTERM set `stop` rather than end the process, so that no image is left
    half-written; a second signal ends it at once (the files are whole either way)."""

    def __enter__(self):
        self.stop, self.received = threading.Event(), []
        self.previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _on_signal(self, signum, frame):
        self.received.append(signum)
        self.stop.set()
        for s in self.previous:
            signal.signal(s, signal.SIG_DFL)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _run_until_done_or_signal(producer, writer, signals, out, processes) -> int:
    """Run both threads until the writer is done, or a signal has stopped it after the image in hand (exit 130 for
    SIGINT, 143 for SIGTERM). The main thread only waits, so a signal is seen at once even while a device
    computes (that batch is dropped, and made by the next run)."""
    writer.thread.start()
    producer.thread.start()
    while writer.thread.is_alive():
        writer.thread.join(0.2)
    for error in (producer.error, writer.error):
        if error is None:
            continue
        if processes == 1:
            raise error
        # The other processes wait for this one's part of the next batch, and jax.distributed's shutdown would
        # wait for them: end now, and the coordination service stops them.
        if isinstance(error, (UserError, *cli._input_errors())):
            print(f"sdflax: error: {' '.join(str(error).split())}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exception(error)
        _exit(2 if isinstance(error, UserError) else 1)
    if signals.received:
        name = signal.Signals(signals.received[0]).name
        print(f"sdflax: stopped by {name} after {writer.written} of {writer.total} images; the manifest in {out} "
              "lists every image written: run the same command again to make the rest", file=sys.stderr)
        _exit(128 + signals.received[0])  # a device may still be computing the dropped batch: do not wait
    producer.thread.join()
    print(f"batch: {writer.written} images written to {out}", file=sys.stderr)
    return 0
