"""`sdflax train`'s run, once everything is checked (train.py): the model loaded, a `sdflax.train.Trainer` made
(over the local devices), restored from --out's last checkpoint, and stepped on the rows `sdflax.train.data` plans
for each update; validation images, loss.png and progress.png as it goes; checkpoints every N updates and on
SIGINT / SIGTERM; the result at the end."""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
import time

import numpy as np

from .manifest import folder_lock
from .request import UserError
from .train_cache import fill_latents, fill_states
from .train_log import TENSORBOARD, TrainLog, write_png
from .train_options import CORE_METHOD, SETTINGS, result_path, toml_text
from .workers import Signals

CHECKPOINTS = "checkpoints"
SAMPLES = "samples"
CHECKPOINT = re.compile(r"checkpoint-(\d+)")
PIPELINES = {}  # the last run's pipeline object (no params): (model, revision) -> pipeline


def train(plan) -> int:
    settings = plan.settings
    process, processes = join(plan.processes)
    if settings["seed"] is None:
        settings["seed"] = int.from_bytes(os.urandom(4), "little") >> 1
    if processes > 1:  # the first process's seed (and its settings.toml's) for all
        from jax.experimental import multihost_utils

        settings["seed"] = int(multihost_utils.broadcast_one_to_all(np.int32(settings["seed"])))
    config = train_config(settings, bool(plan.class_pictures) or bool(settings["class_prompt"]))
    devices = mesh_devices(settings, config.with_prior_preservation, processes)
    out = settings["out"]
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot make it ({e.strerror or e}): choose another --out") from None
    with folder_lock(out, out, process, command="train"):
        if not plan.resumed and process == 0:
            from ..train.files import atomic_write

            atomic_write(os.path.join(out, SETTINGS), [toml_text(settings).encode()])
        with Signals() as signals:
            return Run(plan, config, devices).go(signals)


def train_config(settings, prior):
    from ..train import TrainConfig

    core = {name: settings[name] for name in (
        "learning_rate", "adam_beta1", "adam_beta2", "adam_weight_decay", "adam_epsilon", "max_grad_norm",
        "lr_scheduler", "lr_warmup_steps", "max_train_steps", "gradient_accumulation_steps", "snr_gamma",
        "noise_offset", "prediction_type", "mixed_precision", "gradient_checkpointing", "use_ema", "ema_decay",
        "train_text_encoder", "prior_loss_weight", "rank", "lora_alpha", "init_lora_weights", "placeholder_token",
        "initializer_token", "num_vectors")}
    try:
        return TrainConfig(method=CORE_METHOD[settings["method"]], with_prior_preservation=prior,
                           lora_targets=tuple(settings["lora_targets"]),
                           text_encoder_lora_targets=tuple(settings["text_encoder_lora_targets"]), **core)
    except ValueError as e:
        raise UserError(str(e).replace("TrainConfig: ", "")) from None


def join(args) -> tuple[int, int]:
    """(this process, the process count), as sdflax batch joins them; main() called from Python after JAX has
    started, without --coordinator: this process alone."""
    from jax._src import xla_bridge

    from .batch import join_processes

    if (args.coordinator, args.num_processes, args.process_id) == (None, None, None) and \
            xla_bridge.backends_are_initialized():
        return 0, 1
    return join_processes(args)


def mesh_devices(settings, prior, processes) -> list:
    """The devices the rows are split over: each process's first --devices N (default: all), in process order,
    checked to divide a micro-batch."""
    import jax

    local = jax.local_devices()
    count = settings["devices"] or len(local)
    if count > len(local):
        raise UserError(f"--devices {count}: this process has {len(local)} ({jax.default_backend()})")
    rows, total = settings["train_batch_size"] * (2 if prior else 1), count * processes
    if rows % total:
        where = f"{total} devices" + (f" ({processes} processes of {count})" if processes > 1 else "")
        raise UserError(f"--train-batch-size {settings['train_batch_size']} ({rows} rows a micro-batch) does not "
                        f"split over {where}: give a multiple of {total}, or --devices N")
    return [d for p in range(processes) for d in [d for d in jax.devices() if d.process_index == p][:count]]


class Run:
    def __init__(self, plan, config, devices):
        import jax

        from .run import use_compile_cache
        from .request import Request

        self.plan, self.settings, self.config = plan, plan.settings, config
        s = self.settings
        self.out, self.seed, self.size = s["out"], s["seed"], s["resolution"]
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.main = self.process == 0  # the one that writes --out
        self.status = (lambda msg: print(msg, file=sys.stderr, flush=True)) if s["progress"] else (lambda m: 0)
        use_compile_cache(Request(command="generate", prompt="", cache_dir=s["cache_dir"]))
        count = len(devices)
        self.prior = config.with_prior_preservation
        self.where = f"{count} {jax.default_backend().upper()} device" + ("s" if count > 1 else "") + \
            (f" of {self.processes} processes" if self.processes > 1 else "")
        self.status(f"Loading {s['model']} ...")
        cls = plan.checkpoint.pipeline
        try:
            pipeline, params = cls.from_pretrained(s["model"], revision=s["revision"])
        except (OSError, ValueError) as e:
            raise UserError(f"--model {s['model']}: {e}") from None
        # a run after another in this process samples with the same pipeline object, whose programs are compiled
        same = PIPELINES.get((s["model"], s["revision"]))
        pipeline = same if same is not None and same.spec == pipeline.spec else pipeline
        PIPELINES.clear()
        PIPELINES[s["model"], s["revision"]] = pipeline
        self.class_pictures = plan.class_pictures
        if self.prior:
            self.class_pictures = make_class_pictures(self, pipeline, params)
        mesh = None
        if count > 1:
            from jax.sharding import Mesh

            mesh = Mesh(np.array(devices), ("fsdp",) if s["fsdp"] else ("data",))
        from ..train import Trainer
        from ..train.data import bucket_sizes, row_sizes

        self.trainer = Trainer(pipeline, params, config, seed=self.seed, mesh=mesh)
        self.sdxl = self.trainer.sdxl
        buckets = bucket_sizes(self.size, plan.divisible) if s["buckets"] else None
        self.sizes = row_sizes(plan.pictures, self.size, buckets)
        self.class_sizes = row_sizes(self.class_pictures, self.size)  # their batches' order; their size: batch()
        self.cache = self.encoder = self.states = self.text_encoder = None
        if s["cache_latents"]:
            fill_latents(self)
        if s["cache_text_encoder_outputs"]:
            fill_states(self)
        self.start = self.restore()
        self.log = TrainLog(os.path.join(self.out, "log.jsonl") if self.main else None, self.start,
                            os.path.join(self.out, TENSORBOARD) if s["report_to"] == "tensorboard" else None)

    def pictures(self, stream):
        """(pictures, their training sizes) of a stream: 0 the data's, 1 DreamBooth's class pictures."""
        return ((self.plan.pictures, self.sizes), (self.class_pictures, self.class_sizes))[stream]

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def restore(self) -> int:
        folder = os.path.join(self.out, CHECKPOINTS)
        step, path = 0, None
        if self.main and os.path.isdir(folder):
            for name in os.listdir(folder):  # a save a kill cut short: never a checkpoint
                if re.fullmatch(r"checkpoint-\d+\.(partial|old)-\d+", name):
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            step, path = (checkpoints(folder) or [(0, None)])[-1]
        if self.processes > 1:  # the first process's checkpoint, which restore_checkpoint sends to the others
            from jax.experimental import multihost_utils

            step = int(multihost_utils.broadcast_one_to_all(np.int32(step)))
        if not step:
            return 0
        self.status(f"train: continuing from {path or 'the first process checkpoint'} (update {step})")
        try:
            self.trainer.restore_checkpoint(path)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: cannot continue from it ({e}): remove it to continue from the one before") \
                from None
        return step

    def save(self, step):
        folder = os.path.join(self.out, CHECKPOINTS)
        path = os.path.join(folder, f"checkpoint-{step}")
        if self.main:
            os.makedirs(folder, exist_ok=True)
        self.log.sync()
        try:
            self.trainer.save_checkpoint(path, overwrite=True)
        except OSError as e:
            for name in os.listdir(folder):
                if name.startswith(f"checkpoint-{step}.partial-"):
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            kept = [p for n, p in checkpoints(folder) if n != step]
            raise UserError(f"cannot save {path} ({e.strerror or e}); "
                            f"{kept[-1] if kept else 'no checkpoint'} is kept: make room and run the same command "
                            "again to continue from it") from None
        limit = self.settings["checkpoints_total_limit"]
        if limit and self.main:
            for _, old in checkpoints(folder)[:-limit]:
                shutil.rmtree(old, ignore_errors=True)

    # ---- the rows ---------------------------------------------------------------------------------------------
    def batch(self, step) -> dict:
        """This process's share of update `step`'s rows: of each micro-batch ([instance rows; class rows] with
        prior preservation) the process's slice, as the trainer's mesh puts the global batch together."""
        from ..train.data import batch_at, row_draws

        s = self.settings
        k, b = s["gradient_accumulation_steps"], s["train_batch_size"]
        streams = []
        for stream in range(2 if self.prior else 1):
            pictures, sizes = self.pictures(stream)
            indices = batch_at(step, sizes, [p.repeats for p in pictures], k * b, self.seed, stream)
            dropped, flipped, crops = row_draws(self.seed, step, k * b, s["caption_dropout"] if stream == 0 else 0.0,
                                                s["random_flip"], stream)
            # the class rows at the instance rows' size (their bucket): a class picture is resized to cover it and
            # cropped, as any picture in its nearest bucket (the model's class pictures are all square)
            streams.append([(stream, i, bool(flipped[n]), None if s["center_crop"] else crops[n],
                             streams[0][0][4] if stream else sizes[i], "" if dropped[n] else pictures[i].caption)
                            for n, i in enumerate(indices)])
        rows = [row for m in range(k) for rows in streams for row in rows[m * b:(m + 1) * b]]
        share = len(rows) // k // self.processes  # a micro-batch's rows this process reads
        mine = [n for n in range(len(rows)) if n % (len(rows) // k) // share == self.process]
        arrays, originals, corners = zip(*(self.row(*rows[n][:5]) for n in mine))
        sizes, captions = [rows[n][4] for n in mine], [rows[n][5] for n in mine]
        arrays = np.stack(arrays)
        if self.cache is None:
            batch = {"pixel_values": arrays}
        else:  # (mean, std) of each row: a posterior sample, as the VAE draws one
            noise = np.random.default_rng([self.seed, step, 4]).standard_normal((len(rows), *arrays.shape[2:]),
                                                                                 np.float32)[mine]
            batch = {"latents": arrays[:, 0] + arrays[:, 1] * noise}
        if self.states is None:
            batch["input_ids"] = np.asarray(self.trainer.pipeline.prepare_inputs(list(captions)))
        else:
            states = [self.states.read(self.state_keys[caption]) for caption in captions]
            batch.update({name: np.stack([state[name] for state in states]) for name in states[0]})
        if self.sdxl:
            batch.update(original_size=np.asarray(originals, np.float32),
                         crops_coords_top_left=np.asarray(corners, np.float32),
                         target_size=np.asarray([(h, w) for w, h in sizes], np.float32))
        return batch

    def row(self, stream, index, flip, crop, size):
        """(pixels, or the cached (mean, std) stacked, original (h, w), crop corner) of a picture of the stream at
        `size`."""
        from ..train.data import load_row

        if self.cache is None:
            return load_row(self.pictures(stream)[0][index].path, size, flip, crop)
        mean, std, original, corner = self.cache.read(self.cached[stream, index, flip, size])
        return np.stack([mean, std]), original, corner

    # ---- the caches (train_cache.py) ---------------------------------------------------------------------
    def local_frozen(self, *names):
        """The frozen weights of models, in the compute dtype, on this process's device (its own programs)."""
        import jax
        import jax.numpy as jnp

        dtype = self.trainer.compute_dtype
        return {name: jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                   self.trainer.base_params[name]) for name in names}

    def encode(self, pixels):
        """The VAE posterior's (mean, std) of pixels (B, 3, H, W), scaled as the UNet sees latents."""
        import jax

        if self.encoder is None:
            vae = self.trainer.vae

            def encode(params, pixels):
                mean = vae.encode(params, pixels, 0.0)
                return mean, vae.encode(params, pixels, 1.0) - mean

            self.encoder = jax.jit(encode), self.local_frozen("vae")
        program, params = self.encoder
        return jax.device_get(program(params, pixels))

    def encode_text(self, ids) -> dict:
        """The frozen text encoders' states of one caption's ids, as the training step's own call makes them."""
        import jax

        if self.text_encoder is None:
            self.text_encoder = jax.jit(self.trainer.text.encode_prompt), self.local_frozen(*self.trainer.encoders)
        program, params = self.text_encoder
        encoded = jax.device_get(program(params, ids))
        if self.sdxl:
            return {"prompt_embeds": encoded[0][0], "pooled_prompt_embeds": encoded[1][0]}
        return {"prompt_embeds": encoded[0]}

    # ---- the loop ---------------------------------------------------------------------------------------------
    def go(self, signals) -> int:
        s = self.settings
        total, step = s["max_train_steps"], self.start
        rows = s["train_batch_size"] * s["gradient_accumulation_steps"] * (2 if self.prior else 1)
        if step == 0:
            self.validate(0)
        self.status(f"train: {s['method']} on {len(self.plan.pictures)} pictures, {rows} rows an update, "
                    f"{total} updates on {self.where} ...")
        bar = None
        if s["progress"]:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=step, unit="step", file=sys.stderr, dynamic_ncols=True)
        batch, began, done_at_start = (self.batch(step) if step < total else None), time.perf_counter(), step
        saved = step
        while step < total:
            metrics = self.trainer.step(batch)
            step += 1
            batch = self.batch(step) if step < total else None  # the next rows while the devices compute
            loss = float(metrics["loss"])
            self.log.add(step, loss, float(metrics["learning_rate"]))
            if step == done_at_start + 1:  # the rate leaves the first update's compile out
                began = time.perf_counter()
            if bar is not None:
                rate = (step - done_at_start - 1) / max(time.perf_counter() - began, 1e-9)
                bar.set_postfix_str(f"loss {loss:.4f}, {rate * rows:.2f} images/s", refresh=False)
                bar.update(1)
            if step % s["validation_steps"] == 0 or step == total:
                self.validate(step)
            if step % s["checkpointing_steps"] == 0 or step == total:
                self.save(step)
                saved = step
            if signals.received and step < total:
                if saved != step:
                    self.save(step)
                if bar is not None:
                    bar.close()
                print(f"train: stopped after update {step} of {total}; checkpoints/checkpoint-{step} saved: run the "
                      "same command again to continue", file=sys.stderr)
                return 0
        if bar is not None:
            bar.close()
        self.log.plot(os.path.join(self.out, "loss.png"))
        self.log.close()
        self.write_result()
        return 0

    def write_result(self):
        s, trainer = self.settings, self.trainer
        path = result_path(s)
        if s["method"] == "full":
            trainer.save_pretrained(path, base=s["model"], revision=s["revision"])
        elif s["method"] == "textual-inversion":
            trainer.save_embedding(path, format="a1111" if s["output_format"] == "kohya" else "diffusers")
        else:
            trainer.save_lora(path, format=s["output_format"])
        if not self.main:  # every process gathers the result, the first writes it
            return
        print(path)
        self.status(f"train: {s['max_train_steps']} updates done; the result is {path}")

    # ---- seeing it --------------------------------------------------------------------------------------------
    def validate(self, step):
        """The validation prompts' images at this update (fixed seeds), samples/step-N.png, progress.png and
        loss.png."""
        prompts = self.settings["validation_prompt"]
        if prompts:
            params = self.trainer.params  # every process takes part in gathering them; the first draws
            if not self.main:
                return
            from ..train.plots import image_row

            row = image_row(self.sample(prompts, self.settings["num_validation_images"], self.seed, params))
            os.makedirs(os.path.join(self.out, SAMPLES), exist_ok=True)
            write_png(os.path.join(self.out, SAMPLES, f"step-{step:06d}.png"), row)
            self.log.add_image(step, row)
            self.progress(step)
        if step:
            self.log.plot(os.path.join(self.out, "loss.png"))

    def sample(self, prompts, count, seed, params=None, pipeline=None):
        import jax
        import jax.numpy as jnp

        pipeline = pipeline or self.trainer.pipeline
        texts = [p for p in prompts for _ in range(count)]
        keys = jnp.stack([jax.random.key((seed + j) % 2**32) for _ in prompts for j in range(count)])
        images = pipeline(pipeline.prepare_inputs(texts), params if params is not None else self.trainer.params,
                          keys, num_inference_steps=self.settings["validation_inference_steps"], height=self.size,
                          width=self.size).images
        return pipeline.numpy_to_pil(np.asarray(images))

    def progress(self, step):
        from PIL import Image

        from ..train.plots import progress_picture

        folder = os.path.join(self.out, SAMPLES)
        found = sorted((int(m.group(1)), name) for name in os.listdir(folder)
                       if (m := re.fullmatch(r"step-(\d+)\.png", name)) and int(m.group(1)) <= step)
        rows = []
        for number, name in found:
            with Image.open(os.path.join(folder, name)) as row:
                rows.append((number, row.convert("RGB")))
        write_png(os.path.join(self.out, "progress.png"), progress_picture(rows))


def checkpoints(folder) -> list[tuple[int, str]]:
    """(update, path) of the complete checkpoints in `folder`, oldest first."""
    found = []
    for name in os.listdir(folder):
        match = CHECKPOINT.fullmatch(name)
        path = os.path.join(folder, name)
        if match and all(os.path.isfile(os.path.join(path, f)) for f in ("trainer.json", "state.safetensors")):
            found.append((int(match.group(1)), path))
    return sorted(found)


def make_class_pictures(run, pipeline, params):
    """DreamBooth's class pictures: those in --class-data-dir, and as many more as --num-class-images asks for,
    drawn by the model from --class-prompt (class-NNNNN.png, never over a file) before the first step."""
    from ..train.data import DataError, read_folder

    s = run.settings
    folder, prompt, wanted = os.path.expanduser(s["class_data_dir"]), s["class_prompt"], s["num_class_images"]
    have = len(run.plan.class_pictures)
    if have < wanted and run.main:  # the others read them once it has: --class-data-dir is a folder all see
        os.makedirs(folder, exist_ok=True)
        run.status(f"train: drawing {wanted - have} class pictures of {prompt!r} into {folder} ...")
        index, batch = have, 4
        while index < wanted:
            images = run.sample([prompt], batch, run.seed + 1_000_003 + index, params, pipeline)
            for image in images[:wanted - index]:
                name = os.path.join(folder, f"class-{index:05d}.png")
                while os.path.lexists(name):
                    name = name[:-4] + "-1.png"
                data = io.BytesIO()
                image.save(data, format="PNG")
                with open(name, "xb") as f:
                    f.write(data.getvalue())
                index += 1
    if run.processes > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sdflax train: class pictures")
    try:
        return read_folder(folder, s["caption_column"], prompt, label="--class-data-dir")[:wanted]
    except DataError as e:
        raise UserError(str(e)) from None
