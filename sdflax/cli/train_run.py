"""`sdflax train`'s run, once everything is checked (train.py): the model loaded, a `sdflax.train.Trainer` made
(over the local devices), restored from --out's last checkpoint, and stepped on the rows `sdflax.train.data` plans
for each update; validation images, loss.png and progress.png as it goes; checkpoints every N updates and on
SIGINT / SIGTERM; the result at the end."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import time

import numpy as np

from .manifest import folder_lock
from .request import UserError
from .train_options import CORE_METHOD, SETTINGS, result_path, toml_text
from .workers import Signals

CHECKPOINTS = "checkpoints"
SAMPLES = "samples"
CHECKPOINT = re.compile(r"checkpoint-(\d+)")
PIPELINES = {}  # the last run's pipeline object (no params): (model, revision) -> pipeline
SMOOTHING = 0.9  # loss.png's and log.jsonl's smoothed loss: an exponential moving average, debiased


def train(plan) -> int:
    settings = plan.settings
    if settings["seed"] is None:
        settings["seed"] = int.from_bytes(os.urandom(4), "little") >> 1
    config = train_config(settings, bool(plan.class_pictures) or bool(settings["class_prompt"]))
    devices = local_devices(settings, config.with_prior_preservation)
    out = settings["out"]
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot make it ({e.strerror or e}): choose another --out") from None
    with folder_lock(out, out, 0, command="train"):
        if not plan.resumed:
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


def local_devices(settings, prior) -> list:
    """The local devices the rows are split over (--devices: the first N), checked to divide a micro-batch."""
    import jax

    devices = jax.local_devices()
    count = settings["devices"] or len(devices)
    if count > len(devices):
        raise UserError(f"--devices {count}: this process has {len(devices)} ({jax.default_backend()})")
    rows = settings["train_batch_size"] * (2 if prior else 1)
    if rows % count:
        raise UserError(f"--train-batch-size {settings['train_batch_size']} ({rows} rows a micro-batch) does not "
                        f"split over {count} devices: give a multiple of {count}, or --devices N")
    return devices[:count]


class Run:
    def __init__(self, plan, config, devices):
        import jax

        from .run import use_compile_cache
        from .request import Request

        self.plan, self.settings, self.config = plan, plan.settings, config
        s = self.settings
        self.out, self.seed, self.size = s["out"], s["seed"], s["resolution"]
        self.status = (lambda msg: print(msg, file=sys.stderr, flush=True)) if s["progress"] else (lambda m: 0)
        use_compile_cache(Request(command="generate", prompt="", cache_dir=s["cache_dir"]))
        count = len(devices)
        self.prior = config.with_prior_preservation
        self.where = f"{count} {jax.default_backend().upper()} device" + ("s" if count > 1 else "")
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
        self.class_sizes = row_sizes(self.class_pictures, self.size)
        self.cache = self.encoder = None
        if s["cache_latents"]:
            self.fill_cache()
        self.start = self.restore()
        self.log = TrainLog(os.path.join(self.out, "log.jsonl"), self.start)

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def restore(self) -> int:
        folder = os.path.join(self.out, CHECKPOINTS)
        if not os.path.isdir(folder):
            return 0
        for name in os.listdir(folder):  # a save a kill cut short: never a checkpoint
            if re.fullmatch(r"checkpoint-\d+\.(partial|old)-\d+", name):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        saved = checkpoints(folder)
        if not saved:
            return 0
        step, path = saved[-1]
        self.status(f"train: continuing from {path} (update {step})")
        try:
            self.trainer.restore_checkpoint(path)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: cannot continue from it ({e}): remove it to continue from the one before") \
                from None
        return step

    def save(self, step):
        folder = os.path.join(self.out, CHECKPOINTS)
        path = os.path.join(folder, f"checkpoint-{step}")
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
        if limit:
            for _, old in checkpoints(folder)[:-limit]:
                shutil.rmtree(old, ignore_errors=True)

    # ---- the rows ---------------------------------------------------------------------------------------------
    def batch(self, step) -> dict:
        """Update `step`'s rows (k micro-batches, each [instance rows; class rows] with prior preservation)."""
        from ..train.data import batch_at, row_draws

        s = self.settings
        k, b = s["gradient_accumulation_steps"], s["train_batch_size"]
        rows = []
        for stream, pictures, sizes in ((0, self.plan.pictures, self.sizes),
                                        (1, self.class_pictures, self.class_sizes))[:2 if self.prior else 1]:
            indices = batch_at(step, sizes, [p.repeats for p in pictures], k * b, self.seed, stream)
            dropped, flipped, crops = row_draws(self.seed, step, k * b, s["caption_dropout"] if stream == 0 else 0.0,
                                                s["random_flip"], stream)
            rows.append([(*self.row(stream, i, bool(flipped[n]), None if s["center_crop"] else crops[n]), sizes[i],
                          "" if dropped[n] else pictures[i].caption) for n, i in enumerate(indices)])
        if self.prior:  # each micro-batch: its instance rows, then as many class rows
            rows = [[row for m in range(k) for row in rows[0][m * b:(m + 1) * b] + rows[1][m * b:(m + 1) * b]]]
        arrays, originals, corners, sizes, captions = zip(*rows[0])
        arrays = np.stack(arrays)
        if self.cache is None:
            batch = {"pixel_values": arrays}
        else:  # (mean, std) of each row: a posterior sample, as the VAE draws one
            noise = np.random.default_rng([self.seed, step, 4]).standard_normal(arrays[:, 0].shape, np.float32)
            batch = {"latents": arrays[:, 0] + arrays[:, 1] * noise}
        batch["input_ids"] = np.asarray(self.trainer.pipeline.prepare_inputs(list(captions)))
        if self.sdxl:
            batch.update(original_size=np.asarray(originals, np.float32),
                         crops_coords_top_left=np.asarray(corners, np.float32),
                         target_size=np.asarray([(h, w) for w, h in sizes], np.float32))
        return batch

    def row(self, stream, index, flip, crop):
        """(pixels, or the cached (mean, std) stacked, original (h, w), crop corner) of a picture of the stream."""
        from ..train.data import load_row

        picture, size = ((self.plan.pictures, self.sizes), (self.class_pictures, self.class_sizes))[stream]
        if self.cache is None:
            return load_row(picture[index].path, size[index], flip, crop)
        mean, std, original, corner = self.cache.read(self.cached[stream, index, flip])
        return np.stack([mean, std]), original, corner

    # ---- the latent cache -------------------------------------------------------------------------------------
    def fill_cache(self):
        """Each picture's (and flipped, with --random-flip) posterior, from the cache or encoded into it (at the
        centre crop: the cache holds one crop a picture)."""
        import hashlib

        import jax

        from ..train.data import LatentCache, file_digest, load_row

        s = self.settings
        vae = hashlib.sha256(np.dtype(self.trainer.compute_dtype).name.encode())
        for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(self.trainer.base_params["vae"])[0],
                                 key=lambda item: jax.tree_util.keystr(item[0])):
            vae.update(jax.tree_util.keystr(path).encode() + np.asarray(leaf).tobytes())
        folder = os.path.expanduser(s["latent_cache"]) if s["latent_cache"] else os.path.join(self.out, "cache")
        self.cache, self.cached = LatentCache(folder, vae.hexdigest()), {}
        encoded = read = 0
        for stream, pictures, sizes in ((0, self.plan.pictures, self.sizes),
                                        (1, self.class_pictures, self.class_sizes)):
            for index, picture in enumerate(pictures):
                digest = file_digest(picture.path)
                for flip in (False, True)[:2 if s["random_flip"] else 1]:
                    key = self.cached[stream, index, flip] = self.cache.key(digest, sizes[index], flip)
                    if self.cache.read(key) is not None:
                        read += 1
                        continue
                    pixels, original, corner = load_row(picture.path, sizes[index], flip)
                    mean, std = self.encode(pixels[None])
                    self.cache.write(key, mean[0], std[0], original, corner)
                    encoded += 1
        self.status(f"train: latents of {encoded + read} pictures: {encoded} encoded, {read} read from {folder}")

    def encode(self, pixels):
        """The VAE posterior's (mean, std) of pixels (B, 3, H, W), scaled as the UNet sees latents."""
        import jax

        if self.encoder is None:
            vae = self.trainer.vae

            def encode(params, pixels):
                mean = vae.encode(params, pixels, 0.0)
                return mean, vae.encode(params, pixels, 1.0) - mean

            self.encoder = jax.jit(encode)
        return jax.device_get(self.encoder(self.trainer.frozen, pixels))

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
        print(path)
        self.status(f"train: {s['max_train_steps']} updates done; the result is {path}")

    # ---- seeing it --------------------------------------------------------------------------------------------
    def validate(self, step):
        """The validation prompts' images at this update (fixed seeds), samples/step-N.png, progress.png and
        loss.png."""
        prompts = self.settings["validation_prompt"]
        if prompts:
            images = self.sample(prompts, self.settings["num_validation_images"], self.seed)
            from ..train.plots import image_row

            os.makedirs(os.path.join(self.out, SAMPLES), exist_ok=True)
            write_png(os.path.join(self.out, SAMPLES, f"step-{step:06d}.png"), image_row(images))
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


def write_png(path, image):
    from ..train.files import atomic_write

    data = io.BytesIO()
    image.save(data, format="PNG")
    atomic_write(path, [data.getvalue()])


def make_class_pictures(run, pipeline, params):
    """DreamBooth's class pictures: those in --class-data-dir, and as many more as --num-class-images asks for,
    drawn by the model from --class-prompt (class-NNNNN.png, never over a file) before the first step."""
    from ..train.data import DataError, read_folder

    s = run.settings
    folder, prompt, wanted = os.path.expanduser(s["class_data_dir"]), s["class_prompt"], s["num_class_images"]
    have = len(run.plan.class_pictures)
    if have < wanted:
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
    try:
        return read_folder(folder, s["caption_column"], prompt, label="--class-data-dir")[:wanted]
    except DataError as e:
        raise UserError(str(e)) from None


class TrainLog:
    """log.jsonl: one record an update ({"step", "loss", "smoothed", "learning_rate", "time"}); on a resumed run the
    records past its checkpoint (lost updates, made again) are dropped first."""

    def __init__(self, path, start):
        from ..train.files import atomic_write

        self.path, self.records = path, []
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line a kill cut short
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start:
                    self.records.append(record)
            atomic_write(path, [b"".join(json.dumps(r).encode() + b"\n" for r in self.records)])
        self.file = open(path, "a", encoding="utf-8")

    def add(self, step, loss, learning_rate):
        n = len(self.records) + 1
        last = self.records[-1]["smoothed"] * (1 - SMOOTHING ** (n - 1)) if self.records else 0.0
        average = SMOOTHING * last + (1 - SMOOTHING) * loss
        record = {"step": step, "loss": loss, "smoothed": average / (1 - SMOOTHING ** n),
                  "learning_rate": learning_rate, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def sync(self):
        os.fsync(self.file.fileno())

    def plot(self, path):
        from ..train.plots import loss_plot

        write_png(path, loss_plot([r["step"] for r in self.records], [r["loss"] for r in self.records],
                                  [r["smoothed"] for r in self.records]))
