"""`sdflax batch PROMPTS --out DIR`: one PNG per prompt line, on every device of every process, resumable.

Line n of PROMPTS (counted from 1) becomes `DIR/<n, 6 digits>-<slug>.png`, made with seed S + n - 1 (or its own),
so an image is the same whatever the batch, device or process count, and equals `sdflax generate` with that
seed: each line is a `Request`, made by the same call as generate's (`run.sample_rows`). Each PNG is written under
a temporary name and linked into place (never over a file), then one record is appended to the process's manifest
and fsynced: a run killed at any moment leaves whole PNGs and a manifest that lists them, and the same command
run again makes only the rest. Several processes (`jax.distributed`) split the prompts over one global device
mesh; each writes its own devices' images and its own manifest.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

from . import manifest as files
from .features import having, used
from .features.ip_adapter import check_line_images, line_images
from .output import image_settings, output_target, slug
from .options import add_options
from .parse import positive_int, scale, seed
from .preflight import check_attention, check_checkpoint
from .request import Request, UserError
from .run import (StepBar, check_flags, compiling_line, devices_text, load, out_of_memory_is_one_line, sample_rows,
                  say_between_bars, steps_run, use_compile_cache)
from .workers import Producer, Signals, Writer, run_until_done_or_signal

KEYS = ("prompt", "negative_prompt", "seed", "guidance", "steps", "width", "height")  # what a JSONL line may set
IP_IMAGE = "ip_image"  # and, with --ip-adapter, its image prompts: a path or a list of one per adapter
# A line's own values are checked with the command line's parsers, so that both refuse the same values.
CHECKS = {"seed": seed, "guidance": scale, "steps": positive_int, "width": positive_int, "height": positive_int}
# Bounds on what a prompt file can make the reader hold: a prompt is 77 tokens, so a longer line is a mistake (a
# 16 MB line took 32 s and 2.4 GB to tokenize), and /dev/zero must not grow until killed.
MAX_PROMPTS_BYTES = 64 * 2**20
MAX_LINE_CHARS = 16384


def add_command(commands):
    b = commands.add_parser("batch", help="a file of prompts -> one PNG each, resumable, on many devices and hosts",
                            description="Make one PNG per line of PROMPTS (a text file, one prompt a line, or .jsonl "
                            "with per-line prompt, negative_prompt, seed, guidance, steps, width, height, and "
                            "ip_image with --ip-adapter) in --out, with DIR/manifest.jsonl listing them. Line n uses "
                            "seed S + n - 1 unless it sets its own. Run the same command again to finish an "
                            "interrupted run: done images are skipped. Several processes (--coordinator, or as "
                            "jax.distributed detects them on TPU, SLURM, Kubernetes) split the prompts over all their "
                            "devices.")
    b.add_argument("prompts", metavar="PROMPTS", help="text file (one prompt a line) or .jsonl (one object a line)")
    add_options(b, "batch", exclude=("--num-images", "--grid", "--out"))
    b.add_argument("--out", required=True, metavar="DIR", help="the folder for the PNGs and the manifest")
    b.add_argument("--batch-per-device", type=positive_int, default=1, metavar="N",
                   help="images each device makes at once (default: 1)")
    add_process_flags(b)


def add_process_flags(parser):
    """--coordinator, --num-processes, --process-id: how a command's processes join (`join_processes`)."""
    parser.add_argument("--coordinator", type=host_and_port, metavar="HOST:PORT", help="process 0's address, to "
                        "join several processes (default: as jax.distributed detects a TPU slice, SLURM or Kubernetes "
                        "job; else one process)")
    parser.add_argument("--num-processes", type=positive_int, metavar="N", help="with --coordinator; 1 alone: this "
                        "process only, even inside a cluster job")
    parser.add_argument("--process-id", type=int, metavar="I", help="with --coordinator: this process, 0 .. N-1")


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
    ip_image: tuple = ()  # its own image prompts, one per --ip-adapter; none: --ip-image

    @property
    def name(self):
        return f"{self.number:06d}-{slug(self.prompt)}.png"

    @property
    def program(self):
        """What fixes the compiled program (and the checks against the model): steps and size."""
        return self.steps, self.height, self.width

    def request(self, base: Request, seed: int) -> Request:
        return dataclasses.replace(base, prompt=self.prompt, negative_prompt=self.negative_prompt, seed=seed,
                                   guidance=self.guidance, steps=self.steps, height=self.height, width=self.width,
                                   ip_image=self.ip_image or base.ip_image)


def host_and_port(text):
    """HOST:PORT (an IPv6 host in brackets), as jax.distributed takes the coordinator's address."""
    host, colon, port = text.rpartition(":")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 10.0.0.1:1234, got {text!r}")
    return text


def read_prompts(path, defaults, ip_adapters=0) -> list[Line]:
    """The prompt lines, each checked; a mistake names the line. Blank lines are skipped (and keep their number).
    `defaults`: the command's negative_prompt, guidance, steps, height and width; `ip_adapters`: its --ip-adapter
    count, the image prompts a line's ip_image names."""
    try:
        # newline="": the text as written, so that a lone "\r" stays in its line (see the split below)
        with open(os.path.expanduser(path), encoding="utf-8", newline="") as f:
            text = f.read(MAX_PROMPTS_BYTES + 1)  # characters: at least as many bytes
    except (OSError, UnicodeDecodeError) as e:
        reason = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror or e
        raise UserError(f"PROMPTS {path}: cannot read it ({reason}): give a text file, one prompt a line, or "
                        ".jsonl") from e
    if len(text) > MAX_PROMPTS_BYTES:
        raise UserError(f"PROMPTS {path} is over {MAX_PROMPTS_BYTES // 2**20} MiB: split it into several files")
    jsonl = path.lower().endswith(".jsonl")
    lines = []
    # Lines end at "\n" (or "\r\n") alone: str.splitlines also splits at form feeds and U+2028, U+0085, which
    # would shift every later line's number and seed.
    for number, raw in enumerate(text.split("\n"), 1):
        raw = raw.removesuffix("\r")
        if len(raw) > MAX_LINE_CHARS:
            raise UserError(f"PROMPTS {path} line {number}: {len(raw)} characters, over {MAX_LINE_CHARS}: a prompt is "
                            "77 tokens, the rest is cut off; is this a prompt file?")
        if not raw.strip():
            continue
        values = json_line(path, number, raw, ip_adapters) if jsonl else {"prompt": raw.strip()}
        d = defaults
        lines.append(Line(number, values["prompt"], values.get("negative_prompt", d.negative_prompt),
                          values.get("seed"), values.get("guidance", d.guidance), values.get("steps", d.steps),
                          values.get("height", d.height), values.get("width", d.width), values.get(IP_IMAGE, ())))
    if not lines:
        raise UserError(f"PROMPTS {path} holds no prompt: write one prompt a line"
                        + (', or one {"prompt": ...} object a line' if jsonl else ""))
    return lines


def json_line(path, number, raw, ip_adapters=0) -> dict:
    where = f"PROMPTS {path} line {number}"
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno}): write one object a line, e.g. "
                        '{"prompt": "a red fox", "seed": 3}') from None
    except (ValueError, RecursionError):  # Python's JSON reader: a number over 4300 digits, nesting past its stack
        raise UserError(f"{where}: not JSON sdflax reads (a number of thousands of digits, or nesting thousands "
                        'deep): write one flat object a line, e.g. {"prompt": "a red fox", "seed": 3}') from None
    if not isinstance(values, dict):
        raise UserError(f'{where}: a JSON {type(values).__name__}, not an object: write {{"prompt": ...}}')
    if IP_IMAGE in values:
        values[IP_IMAGE] = line_images(where, values[IP_IMAGE], ip_adapters)
    unknown = [key for key in values if key not in (*KEYS, IP_IMAGE)]
    if unknown:
        keys = (*KEYS, IP_IMAGE) if ip_adapters else KEYS
        raise UserError(f"{where}: unknown key {unknown[0]!r}: a line may set {', '.join(keys)}")
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
    with contextlib.ExitStack() as held:
        return run_lines(args, held)


def run_lines(args, held) -> int:
    """The command; `held` keeps the folder's lock, and from when the inputs are read the signal handlers, until
    the run ends. Until then a signal ends the process as it would any other (nothing is written yet), even one
    blocked reading a FIFO given as PROMPTS."""
    status = say_between_bars if args.progress is not False else (lambda m: 0)
    show_bar = sys.stderr.isatty() if args.progress is None else args.progress
    lines = read_prompts(args.prompts, args, len(args.ip_adapter))  # every mistake before JAX starts
    folder = output_folder(args.out)
    base = Request.from_args(args, command="generate", prompt=lines[0].prompt)
    check_flags(base, batch=True)  # a T2I-Adapter's picture is every line's, resized to its size
    check_line_images(base, lines, args.prompts)
    for _, check in having("check_lines", used(base)):  # the features' checks of the lines' own values
        check(base, lines, args.prompts)
    files.read_manifests(folder)  # a manifest that is not ours: refused before JAX starts
    process, processes = join_processes(args)  # before anything starts JAX's backend (the scheduler checks do)
    held.enter_context(files.folder_lock(folder, args.out, process))
    records = files.read_manifests(folder)  # again, now that no other run writes to them
    lines, checkpoints = with_default_steps(lines, check_lines(base, lines, args.prompts))
    signals = held.enter_context(Signals())  # from here a signal stops the run after the image in hand

    import jax

    from ..parallel import device_mesh, replicate_on
    from ..pipeline.checks import guided

    cache_dir = use_compile_cache(base)
    backend = jax.default_backend()
    dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    check_attention(base, backend, dtype)

    def checkpoint_of(line):
        return dataclasses.replace(checkpoints[line.program], guidance=guidance(line, checkpoints))

    def settings_of(line, seed):
        """What the line's PNG records (and its manifest record): what a rerun checks to be this command's."""
        checkpoint = checkpoint_of(line)
        return {**image_settings(line.request(base, seed), checkpoint.scheduler, checkpoint, dtype), "seed": seed}

    first_seed, seeds, manifest, todo = resume(args, folder, lines, settings_of, records, process, processes)
    if not todo:
        print(f"batch: all {len(lines)} images are in {args.out} already", file=sys.stderr)
        return 0

    mesh = device_mesh(jax.devices())
    status(f"Loading {args.model} in {dtype} ...")
    pipeline, params = load(base, checkpoints[todo[0].program], dtype)
    params = replicate_on(params, mesh)  # once: every batch then finds them in place
    batch = args.batch_per_device * mesh.size
    plan = make_plan(todo, batch, checkpoints)
    mine = own_rows(mesh, args.batch_per_device, process)
    total = sum(1 for _, rows in plan for r in mine if r < len(rows))
    where = devices_text(mesh.size, backend) + (f" in {processes} processes" if processes > 1 else "")
    status(f"batch: {len(todo)} of {len(lines)} images to make ({len(lines) - len(todo)} done before), "
           f"{batch} at a time on {where}; this process writes {total}")

    compiled = set()

    def make(key, lines):
        """This process's images of one batch; the batch is padded with its last line."""
        rows = lines + [lines[-1]] * (batch - len(lines))
        checkpoint = checkpoint_of(rows[0])
        program, scale, zeros = key
        if (program, zeros, guided(scale)) not in compiled:  # what fixes the compiled program
            compiled.add((program, zeros, guided(scale)))
            status(compiling_line(rows[0].steps, checkpoint, batch, where, cache_dir))
        requests = [line.request(base, seeds[line.number]) for line in rows]
        call = sample_rows(pipeline, params, mesh, checkpoint, requests)
        bar = StepBar(steps_run(requests[0], checkpoint), repr(("batch", args.model, key, batch, dtype, where)),
                      cache_dir, leave=False) if show_bar else contextlib.nullcontext()
        with bar:
            return out_of_memory_is_one_line(call, f"{batch} images of {checkpoint.width}x{checkpoint.height} on "
                                             f"{where}", "use a smaller --batch-per-device or --dtype bfloat16")

    writer = Writer(folder, manifest, process, total, status, lambda line: settings_of(line, seeds[line.number]),
                    first_seed, pipeline.numpy_to_pil, signals.stop)
    return run_until_done_or_signal(Producer(make, plan, mine, writer), writer, signals, args.out, processes)


def resume(args, folder, lines, settings_of, records, process, processes):
    """(the command's seed S, each line's seed, this process's manifest, the lines still to make): what the
    manifests list is done, once checked to be this command's images, and a PNG a kill left unlisted is
    adopted."""
    first_seed = base_seed(args, records, processes)
    seeds = {line.number: (line.seed if line.seed is not None else (first_seed + line.number - 1) % 2**32)
             for line in lines}
    keys = {line.number: files.image_key(settings_of(line, seeds[line.number])) for line in lines}
    done = files.check_records(records, lines, keys, args.out, folder)
    manifest = files.Manifest(os.path.join(folder, "manifest.jsonl" if processes == 1 else
                                           f"manifest.{process}.jsonl"))
    files.remove_own_temporaries(folder, process)
    orphans = [line.number for line in lines if line.number not in done
               and files.is_orphan(folder, line, keys, args.out)]
    done, adopt = files.agree(lines, done, orphans, args.prompts, process, processes)
    for line in lines:
        if line.number in adopt:  # its text chunks hold these settings (is_orphan checked the key ones)
            manifest.append(files.record(line, first_seed, settings_of(line, seeds[line.number]), process,
                                         os.path.getmtime(os.path.join(folder, line.name))))
    return first_seed, seeds, manifest, [line for line in lines if line.number not in done]


def output_folder(out) -> str:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file: give a folder (sdflax batch writes one PNG a prompt and its "
                        "manifest there)")
    return output_target(os.path.join(out, "")).folder  # made, and checked to be writable


def guidance(line, checkpoints):
    return line.guidance if line.guidance is not None else checkpoints[line.program].guidance


def check_lines(base, lines, prompts) -> dict:
    """The checks of steps and size against the checkpoint's configs, once per program; a refusal names the
    first line that asks for it."""
    checkpoints = {}
    for line in lines:
        if line.program in checkpoints:
            continue
        steps, height, width = line.program
        try:
            request = dataclasses.replace(base, steps=steps, height=height, width=width)
            checkpoints[line.program] = check_checkpoint(request, {})[0]
        except UserError as e:
            if line.program == (base.steps, base.height, base.width):
                raise  # the command line's values
            raise UserError(f"PROMPTS {prompts} line {line.number}: {e}") from e
    return checkpoints


def with_default_steps(lines, checkpoints) -> tuple[list, dict]:
    """The lines and their checkpoints with the steps each runs: its own or --steps, else the pipeline's."""
    lines = [dataclasses.replace(line, steps=checkpoints[line.program].steps) for line in lines]
    return lines, {(checkpoint.steps, *program[1:]): checkpoint for program, checkpoint in checkpoints.items()}


def join_processes(args) -> tuple[int, int]:
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
        except RuntimeError as e:  # JAX already started in this process (main() called from Python)
            raise UserError(f"JAX has started in this process, so it cannot join other processes: run sdflax "
                            f"{args.command} in a process of its own, or pass --num-processes 1") from e
    return jax.process_index(), jax.process_count()


def base_seed(args, records, processes) -> int:
    """--seed, else the one an earlier run of this command chose (its manifest says), else random; one for all."""
    if args.seed is not None:
        return args.seed
    earlier = [r["batch_seed"] for r in records if "batch_seed" in r]
    first = earlier[0] if earlier else int.from_bytes(os.urandom(4), "little") >> 1
    if processes > 1:
        from jax.experimental import multihost_utils

        first = int(multihost_utils.broadcast_one_to_all(first))
    return first


def make_plan(todo, batch, checkpoints) -> list:
    """[(key, lines)]: batches of `batch` lines, each of one compiled program and one guidance scale (the
    pipeline takes one scale per call, traced: a new scale does not recompile), in the order of the file."""
    groups = {}
    for line in todo:
        # SDXL's unconditional input is zeros without a negative prompt, the empty prompt's encoding with one
        zeros = checkpoints[line.program].family.zeros_for_empty_negative and not line.negative_prompt
        groups.setdefault((line.program, guidance(line, checkpoints), zeros), []).append(line)
    return [(key, lines[i:i + batch]) for key, lines in groups.items() for i in range(0, len(lines), batch)]


def own_rows(mesh, per_device, process) -> list[int]:
    """The rows of a batch that this process's devices make, in the mesh's order (generate_sharded's)."""
    return [row for row in range(per_device * mesh.size)
            if mesh.devices.flat[row // per_device].process_index == process]
