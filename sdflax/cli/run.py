"""Running a request: load the pipeline with what its features add (ControlNets, T2I- and IP-Adapters, LoRAs,
embeddings, a refiner), prepare the inputs, and make the images over a device mesh with `generate_sharded`, the one
mode of `sdflax generate`, `img2img`, `inpaint` and `batch` (`sample_rows`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import nullcontext

import numpy as np

from .. import cache
from .features import having, name, used
from .features.prompt_syntax import prepared
from .output import image_settings, output_target, save
from .pictures import read_pictures
from .preflight import check_attention, check_checkpoint, command_line_side
from .request import Made, UserError

# The events JAX records for tracing, lowering and compiling (or loading from the disk cache) one program.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def run(request) -> int:
    """generate, img2img and inpaint: check everything cheap, load, prepare the inputs, compile and run, write."""
    status = (lambda msg: print(msg, file=sys.stderr, flush=True)) if request.progress is not False else (lambda m: 0)
    target = output_target(request.out, request.grid, request.num_images)  # before anything slow
    pictures = read_pictures(request)  # {"image": ..., "mask": ...} for img2img / inpaint
    check_flags(request)  # the features' pictures are read again at the output size, the IP images in the rows
    if request.progress is False:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    checkpoint, pictures = check_checkpoint(request, pictures)
    request = dataclasses.replace(request, steps=checkpoint.steps)  # --steps, or the pipeline's default

    import jax  # after the checks above, so that mistakes are reported without starting JAX

    from ..parallel import device_mesh

    cache_dir = use_compile_cache(request)
    backend = jax.default_backend()
    dtype = request.dtype or ("float32" if backend == "cpu" else "bfloat16")
    check_attention(request, backend, dtype)
    mesh = device_mesh()
    num_images = request.num_images or mesh.size
    seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    target.check_unused(request.prompt, [(seed + i) % 2**32 for i in range(num_images)], request.grid)

    status(f"Loading {request.model} in {dtype} ...")
    start = time.perf_counter()
    pipeline, params = load(request, checkpoint, dtype)
    stage = next_stage(request, checkpoint, dtype)
    seeds, call = prepare(request, pipeline, params, checkpoint, pictures, seed, mesh, stage)
    load_s = time.perf_counter() - start

    where = devices_text(mesh.size, backend)
    status(compiling_line(request.steps, checkpoint, len(seeds), where, cache_dir))
    show_bar = sys.stderr.isatty() if request.progress is None else request.progress
    program = (request.command, request.model, request.scheduler, checkpoint.width, checkpoint.height, len(seeds),
               dtype, where, sorted(name(feature) for feature in used(request)))  # what the bar's pace depends on
    with CompileClock() as clock:
        start = time.perf_counter()
        with StepBar(steps_run(request, checkpoint), repr(program), cache_dir) if show_bar else nullcontext():
            out = out_of_memory_is_one_line(call, f"{len(seeds)} image(s) of {checkpoint.width}x"
                                            f"{checkpoint.height} on {where}", "use fewer --num-images, a smaller "
                                            "size, or --dtype bfloat16")
        total_s = time.perf_counter() - start
    images, trajectory = out if isinstance(out, tuple) else (out, None)  # a trajectory where a feature asks
    paths = save(request, target, pipeline.numpy_to_pil(images)[:num_images], seeds[:num_images],
                 image_settings(request, pipeline.scheduler, checkpoint, dtype))
    made = Made(pipeline, params, checkpoint, images, trajectory, seeds, paths)
    for _, write in having("write", used(request)):
        write(request, made)

    cached = " (from the disk cache)" if clock.cache_hits else ""
    print(f"seed {seeds[0]}: load {load_s:.1f} s, compile {clock.seconds:.1f} s{cached}, "
          f"generate {max(total_s - clock.seconds, 0.0):.1f} s for {len(seeds)} image(s)", file=sys.stderr)
    return 0


def check_flags(request, batch=False):
    """Each feature's flags agree and its files and pictures are there (`batch`: `sdflax batch`'s, whose lines
    may give their own image prompts)."""
    for _, check in having("check_flags"):
        check(request, batch)


def use_compile_cache(request) -> str | None:
    """JAX's compilation cache in --cache-dir or sdflax's cache folder (None: SDFLAX_CACHE_DIR=off), turned on
    before the first compile: the one place the command line does it."""
    return cache.enable_compile_cache(os.path.expanduser(request.cache_dir) if request.cache_dir else None)


def compiling_line(steps, checkpoint, count, where, cache_dir) -> str:
    """The status line before a program's first call (generate's and batch's)."""
    strength = f" (strength {checkpoint.strength})" if checkpoint.strength is not None else ""
    return (f"Compiling for {steps} steps{strength} at {checkpoint.width}x{checkpoint.height}, {count} image(s) on "
            f"{where} (once per setting; {f'kept in {cache_dir}' if cache_dir else 'not kept'}) ...")


def devices_text(count, backend) -> str:
    return f"{count} {backend.upper()} device" + ("s" if count > 1 else "")


def out_of_memory_is_one_line(call, what, fix):
    """call(), with the device running out of memory told in one line, not XLA's dump."""
    import jax

    try:
        return call()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise UserError(f"out of memory making {what}: {fix}") from None


# ---- loading ------------------------------------------------------------------------------------------------

def load(request, checkpoint, dtype):
    """(pipeline, params) of the checkpoint's pipeline class, made with the features' models (ControlNets,
    T2I-Adapters) and then given theirs (IP-Adapters, LoRAs, embeddings)."""
    import jax.numpy as jnp

    kind, dtype, features = checkpoint.pipeline, getattr(jnp, dtype), used(request)
    components, added = {}, {}
    try:
        for _, made in having("components", features):
            parts, params = made(request, dtype)
            components.update(parts)
            added.update(params)
        if checkpoint.single_file:  # read by its family's layout, its errors in the family's flags
            pipeline, params = command_line_side(checkpoint.family).load_single_file(request, kind, dtype,
                                                                                     components)
        else:
            pipeline, params = kind.from_pretrained(request.model, revision=request.revision, dtype=dtype,
                                                    scheduler=request.scheduler, attention=request.attention,
                                                    **components)
    except (OSError, ValueError) as e:  # files missing, unreadable or not matching their config
        raise UserError(str(e)) from e
    params = {**params, **added}
    for _, add in having("load", features):
        pipeline, params = add(request, pipeline, params, dtype)
    return pipeline, params


# ---- inputs and the call ------------------------------------------------------------------------------------

def next_stage(request, checkpoint, dtype):
    """(the feature, what it loaded) of a feature the call hands its latents to (a refiner), or None."""
    return next(((feature, load(request, checkpoint, dtype)) for feature, load in having("next_stage", used(request))),
                None)


def prepare(request, pipeline, params, checkpoint, pictures, seed, mesh, stage=None):
    """(seeds, call() -> images): the images fill every device of `mesh`, and image i has its own key,
    seed + i, so it does not depend on the batch it was made in."""
    from ..parallel import replicate_on

    per_device = -(-(request.num_images or mesh.size) // mesh.size)
    seeds = [(seed + i) % 2**32 for i in range(per_device * mesh.size)]
    rows = [dataclasses.replace(request, seed=s) for s in seeds]
    return seeds, sample_rows(pipeline, replicate_on(params, mesh), mesh, checkpoint, rows, pictures, stage)


def sample_rows(pipeline, params, mesh, checkpoint, rows, pictures=None, stage=None):
    """call() -> this process's images of `rows` (requests of one program and guidance scale that differ
    in prompts, seed and image prompts), made by `generate_sharded` over `mesh`, the same pictures for every row.
    With a `stage` (`next_stage`: a refiner) the call hands its latents on to it."""
    import jax

    features = used(rows[0])
    values = {name(feature): checkpoint.features.get(name(feature)) for feature in features}

    def configure(pipe):
        for feature, set_up in having("configure", features):
            pipe = set_up(pipe, values[name(feature)])
        return pipe

    pipeline = configure(pipeline)
    n = len(rows)
    ids, weights = prepared(pipeline, rows[0], [r.prompt for r in rows], prompt_arguments(rows, features))
    # Pass negative ids even for an empty prompt (it is SD's and SD 3's unconditional one): one program with or
    # without them. SDXL's default is zeros for no negative prompt (force_zeros_for_empty_prompt): None there.
    negative = any(r.negative_prompt or r.negative_prompt_2 for r in rows)
    neg_ids, neg_weights = (None, None) if checkpoint.family.zeros_for_empty_negative and not negative else prepared(
        pipeline, rows[0], [r.negative_prompt for r in rows], prompt_arguments(rows, features, negative=True))
    # one key per image (sdflax.random_draws), as numpy: every process of a mesh spanning several passes them all
    keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(r.seed))) for r in rows])
    arrays, extra = [], {}
    if pictures:
        from ..pipeline.images import preprocess_images, preprocess_images_and_masks

        try:
            if "mask" in pictures:
                arrays = list(preprocess_images_and_masks([pictures["image"]], [pictures["mask"]],
                                                          pipeline.vae_scale_factor))
            else:
                arrays = [preprocess_images([pictures["image"]], pipeline.vae_scale_factor)]
        except ValueError as e:
            raise UserError(str(e)) from e
        arrays = [np.repeat(x, n, axis=0) for x in arrays]  # the same for every row
        if checkpoint.strength is not None:
            extra["strength"] = checkpoint.strength
    for feature, arguments in having("call_arguments", features):
        positional, keywords = arguments(pipeline, values[name(feature)], rows)
        arrays, extra = arrays + positional, {**extra, **keywords}
    if not pictures:
        extra.update(height=checkpoint.height, width=checkpoint.width)
    if weights is not None:  # A1111's prompt syntax
        extra.update(prompt_weights=weights, neg_prompt_weights=neg_weights)
    request = rows[0]

    def call(pipe=None, images=(), **more):  # pipe, images: a next stage's pipeline and pictures
        arguments = {"num_inference_steps": request.steps, "guidance_scale": checkpoint.guidance,
                     "neg_prompt_ids": neg_ids, "mesh": mesh, **extra, **more}
        return (pipe or pipeline).generate_sharded(ids, *images, *arrays, params, keys, **arguments)

    if stage is None:
        return call
    feature, loaded = stage  # loaded None: the stage runs this pipeline's models (hires fix)
    return feature.staged(call, pipeline if loaded is None else loaded, mesh, checkpoint, rows, keys, configure)


def prompt_arguments(rows, features, negative=False) -> dict:
    """prepare_inputs' keywords: the rows' second prompts (each row's prompt where it gives none), only where given
    (SD's pipelines take none), and the features' (SD 3's T5 prompts)."""
    prefix = "negative_prompt" if negative else "prompt"
    given = [getattr(r, f"{prefix}_2") for r in rows]
    arguments = {"prompts_2": [g or getattr(r, prefix) for g, r in zip(given, rows)]} if any(given) else {}
    for _, more in having("prompt_arguments", features):
        arguments.update(more(rows, negative))
    return arguments


# ---- progress and timing ------------------------------------------------------------------------------------

def steps_run(request, checkpoint) -> int:
    """The steps of the schedule the model runs: img2img and inpaint skip the first 1 - strength of them (with a
    refiner, base and refiner run them all between them), and a feature's second pass adds its own (hires fix)."""
    from ..pipeline.starts import start_step

    steps = request.steps if checkpoint.strength is None else request.steps - start_step(request.steps,
                                                                                        checkpoint.strength)
    return steps + sum(after(request, checkpoint) for _, after in having("steps_after", used(request)))


class StepBar:
    """A tqdm bar of a call's denoising steps that the clock moves, at the seconds per step the same program took the
    last time (kept in the compile cache's folder, `step-seconds.json`): a host callback in the program would make
    JAX keep it out of its disk cache and compile it on every run. The clock starts when the last compile (or load
    from the cache) ends; the bar stops a step short of the end until the call returns. With no earlier run it
    counts the seconds, then records this run's pace for the next one.

        with StepBar(steps, key, folder): images = call()
    """

    FILE, KEPT = "step-seconds.json", 256  # programs remembered, the newest

    def __init__(self, steps, key, folder, desc="denoising", leave=True, tick_s=0.25):
        self.steps, self.key, self.desc, self.leave, self.tick_s = steps, key, desc, leave, tick_s
        self.path = os.path.join(folder, self.FILE) if folder else None
        self.pace = self.read().get(key)  # seconds a step, or None
        self.started, self.done = time.perf_counter(), threading.Event()

    def read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                paces = json.loads(f.read(1 << 20))  # a file of another kind: no estimate, never an error
            return paces if isinstance(paces, dict) else {}
        except (OSError, TypeError, ValueError):
            return {}

    def __enter__(self):
        from jax import monitoring
        from tqdm import tqdm

        total = self.steps if self.pace else None
        self.bar = tqdm(total=total, desc=self.desc, unit="step" if total else "s", file=sys.stderr,
                        leave=self.leave, dynamic_ncols=True, bar_format=None if total else "{desc}: {elapsed} (first run: no estimate)")
        monitoring.register_event_duration_secs_listener(self.on_compiled)
        self.thread = threading.Thread(target=self.tick, name="sdflax-step-bar", daemon=True)
        self.thread.start()
        return self

    def on_compiled(self, event, duration, **kwargs):
        if event in COMPILE_EVENTS:
            self.started = time.perf_counter()  # the program runs after its compile

    def tick(self):
        while not self.done.wait(self.tick_s):
            elapsed = time.perf_counter() - self.started
            if self.pace:
                self.bar.update(min(int(elapsed / self.pace), self.steps - 1) - self.bar.n)
            else:
                self.bar.refresh()

    def __exit__(self, kind, *exc):
        from jax import monitoring

        self.done.set()
        self.thread.join()
        monitoring.unregister_event_duration_listener(self.on_compiled)
        if kind is None:
            pace = (time.perf_counter() - self.started) / max(self.steps, 1)
            if self.bar.total:
                self.bar.update(self.steps - self.bar.n)
            self.bar.close()
            self.write(pace)
        else:
            self.bar.close()

    def write(self, pace):
        """This run's pace, kept for the next run of the program (written whole, or not at all)."""
        if self.path is None:
            return
        paces = self.read()
        paces.pop(self.key, None)
        paces[self.key] = pace
        paces = dict(list(paces.items())[-self.KEPT:])
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(paces, f)
                os.replace(temporary, self.path)
            finally:
                if os.path.exists(temporary):
                    os.remove(temporary)
        except OSError:
            pass  # a read-only or full cache folder: the next run counts the seconds again


def say_between_bars(message):
    """A status line on stderr that a step bar, where one is drawn, is redrawn under."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


class CompileClock:
    """Seconds JAX spends tracing, lowering and compiling (or loading compiled programs) inside the block."""

    def __enter__(self):
        from jax import monitoring

        self.seconds, self.cache_hits = 0.0, 0
        monitoring.register_event_duration_secs_listener(self.on_duration)
        monitoring.register_event_listener(self.on_event)
        return self

    def __exit__(self, *exc):
        from jax import monitoring

        monitoring.unregister_event_duration_listener(self.on_duration)
        monitoring.unregister_event_listener(self.on_event)

    def on_duration(self, event, duration, **kwargs):
        if event in COMPILE_EVENTS:
            self.seconds += duration

    def on_event(self, event, **kwargs):
        if event == CACHE_HIT_EVENT:
            self.cache_hits += 1
