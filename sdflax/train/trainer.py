"""`Trainer`: one compiled optimizer update over a pipeline's own models and params.

The trained weights are a pytree beside the frozen params (a LoRA's down / up, the UNet's weights, a new token's
embedding rows); `apply` puts them into the params inside the loss, so gradients reach only them and the modules
are the pipeline's, unchanged. An update is one program: the micro-batches of a gradient accumulation are a
`lax.scan`, their gradients averaged (accelerate divides each loss by their number), then clipped and applied.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ..loading.files import read_safetensors
from ..loading.lora import merge_lora
from ..pipeline.core import config_dict
from ..pipeline.vae import VAE
from ..loading.embeddings import add_rows
from . import lora as lora_lib
from .config import TrainConfig
from .files import fsync_folder, write_safetensors
from .objective import NoiseSchedule, denoising_loss
from .optim import LossScale, ema_decay_at, ema_update, learning_rate_schedule, optimizer
from .pretrained import save_pretrained

TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
SIZE_IDS = ("original_size", "crops_coords_top_left", "target_size")  # SDXL's micro-conditioning, per row
CHECKPOINT_VERSION = 1
MESH_AXES = ("data", "fsdp")
PROGRAMS = {}  # the compiled (update, loss) of this process's trainers, by what makes them (`Trainer._programs`)
MAX_PROGRAMS = 8


@flax.struct.dataclass
class TrainState:
    step: jnp.ndarray  # int32: optimizer updates done
    trainable: Any  # what `apply` puts into the params
    opt_state: Any
    ema: Any  # the trainable's exponential moving average (use_ema), else None
    key: jnp.ndarray  # uint32 (2,): the draws of the next update come from it
    loss_scale: LossScale | None = None  # mixed_precision="fp16"


class Trainer:
    """Trains `pipeline`'s model from `params` as `config` says (`TrainConfig`). `initial_lora`: a LoRA file whose
    down and up weights start a LoRA training (else A random from `seed`, B zero).

    `mesh`: a `jax.sharding.Mesh` over the devices to train on (None: the default device), with a "data" axis, an
    "fsdp" axis or both. The batch's rows are split over all its devices; the gradients of the global batch are
    averaged inside the program. On an "fsdp" axis the weights, trained and frozen, and the optimizer state are
    sharded too (each array along its largest dimension that the axis divides), so that a full SDXL fine-tune fits.
    Over several processes (`jax.distributed`), each passes its own rows."""

    def __init__(self, pipeline, params, config: TrainConfig, initial_lora=None, seed: int = 0, mesh=None):
        if getattr(pipeline, "unet", None) is None:
            raise ValueError(f"{type(pipeline).__name__}: training is for UNet checkpoints (SD 1.x, 2.x, SDXL); "
                             "SD 3.x's transformer is not supported yet")
        if initial_lora is not None and config.method != "lora":
            raise ValueError(f"initial_lora is for method='lora', not {config.method!r}")
        self.config = config
        self.sdxl = getattr(pipeline, "text_encoder_2", None) is not None
        self.encoders = tuple(name for name in TEXT_ENCODERS if getattr(pipeline, name, None) is not None)
        self.schedule = NoiseSchedule.from_config(pipeline.scheduler_base_config or config_dict(pipeline.scheduler),
                                                  config.prediction_type)
        key, lora_key = jax.random.split(jax.random.PRNGKey(seed))
        pipeline, params, trainable = self._trainable(pipeline, params, initial_lora, lora_key)
        self.pipeline = pipeline
        # the params `trainer.params` puts the training into: a full fine-tune's trained models are not kept twice
        self.base_params = {name: part for name, part in params.items()
                            if config.method != "full" or name not in trainable}
        # float32 master weights, copies: the update donates its state's buffers, never the caller's params
        trainable = jax.tree.map(lambda x: jnp.array(x, jnp.float32), trainable)
        self.compute_dtype = {"no": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[config.mixed_precision]
        # the frozen weights the loss reads, in the compute dtype
        self.frozen = jax.tree.map(lambda x: x.astype(self.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                                   else x, self.base_params)
        self.unet = pipeline.unet.clone(dtype=self.compute_dtype, gradient_checkpointing=config.gradient_checkpointing)
        text = pipeline.spec.text
        self.text = dataclasses.replace(text, dtype=self.compute_dtype, **{
            name: getattr(text, name).clone(dtype=self.compute_dtype) for name in self.encoders})
        self.vae = VAE(pipeline.vae.clone(dtype=self.compute_dtype), pipeline.text.upcast_vae(pipeline.vae))
        self.tx = optimizer(config)
        self.learning_rate = learning_rate_schedule(config)
        state = TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable, opt_state=self.tx.init(trainable),
                           ema=jax.tree.map(jnp.copy, trainable) if config.use_ema else None, key=key,
                           loss_scale=LossScale.initial() if config.mixed_precision == "fp16" else None)
        self.mesh = mesh
        if mesh is None:
            self.state = state
        else:
            unknown = set(mesh.axis_names) - set(MESH_AXES)
            if unknown:
                raise ValueError(f"the training mesh's axes are {MESH_AXES} (or one of them), not {mesh.axis_names}")
            self.state = jax.device_put(state, self._shardings(state))
            self.frozen = jax.device_put(self.frozen, self._shardings(self.frozen))
        self._step, self._loss = self._programs()

    def _programs(self):
        """(the update, the loss), compiled; shared by the trainers of one process whose programs are the same
        (equal models, config, schedule, LoRA alphas, new tokens and mesh), so that a second trainer (a resumed
        run, another seed) neither traces nor compiles again. They hold a copy of this trainer without its
        arrays."""
        shell = copy.copy(self)
        shell.state = shell.frozen = shell.base_params = None
        try:
            key = (self.config, jnp.dtype(self.compute_dtype).name, self.unet, self.text, self.vae,
                   self.schedule.alpha_prod.tobytes(), self.schedule.prediction_type, self.pipeline.vae_scale_factor,
                   self.pipeline.vae.config.latent_channels, jnp.dtype(self.pipeline.dtype).name, self.mesh,
                   json.dumps(getattr(self, "alphas", None), sort_keys=True),
                   json.dumps({k: v.tolist() for k, v in getattr(self, "token_ids", {}).items()}, sort_keys=True))
            hash(key)
        except TypeError:  # a part that does not hash: programs of its own
            key = None
        if key is not None and key in PROGRAMS:
            PROGRAMS[key] = PROGRAMS.pop(key)  # the most recently used last
            return PROGRAMS[key]
        kwargs = {}
        if self.mesh is not None:
            kwargs["out_shardings"] = (self._shardings(self.state), NamedSharding(self.mesh, PartitionSpec()))
        programs = jax.jit(shell._update, donate_argnums=(0,), **kwargs), jax.jit(shell._mean_loss)
        if key is not None:
            PROGRAMS[key] = programs
            while len(PROGRAMS) > MAX_PROGRAMS:
                PROGRAMS.pop(next(iter(PROGRAMS)))
        return programs

    def _trainable(self, pipeline, params, initial_lora, key):
        """(pipeline, params, what the method trains): a textual inversion's pipeline and params gain the token."""
        config = self.config
        if config.method == "textual_inversion":
            pipeline, params, self.token_ids, trainable = _add_placeholder(pipeline, params, config, self.encoders)
            return pipeline, params, trainable
        if config.method == "full":
            return pipeline, params, {name: params[name] for name in
                                      ("unet", *(self.encoders if config.train_text_encoder else ()))}
        if initial_lora is not None:
            trainable, self.alphas = lora_lib.read_initial_lora(initial_lora, params, pipeline.unet.config)
            self.lora_targets = None  # the saved file names its modules
            return pipeline, params, trainable
        names = {"unet": config.lora_targets, **{name: config.text_encoder_lora_targets for name in self.encoders
                                                 if config.train_text_encoder}}
        targets = {component: lora_lib.find_targets(params[component], wanted) for component, wanted in names.items()}
        for component, paths in targets.items():
            if not paths:
                raise ValueError(f"no module of {component} matches the LoRA targets {names[component]}")
        trainable = lora_lib.init_lora(params, targets, config.rank, key, config.init_lora_weights)
        self.alphas = {c: {name: config.alpha for name in modules} for c, modules in trainable.items()}
        self.lora_targets = names
        return pipeline, params, trainable

    def _shardings(self, tree):
        """Each array's sharding on the mesh: along its largest dimension the "fsdp" axis divides, else replicated."""
        mesh = self.mesh
        size = mesh.shape.get("fsdp", 1)

        def sharding(x):
            spec = [None] * np.ndim(x)
            for dim in sorted(range(np.ndim(x)), key=lambda d: -np.shape(x)[d]):
                if size > 1 and np.shape(x)[dim] % size == 0:
                    spec[dim] = "fsdp"
                    break
            return NamedSharding(mesh, PartitionSpec(*spec))

        return jax.tree.map(sharding, tree)

    def _place(self, tree):
        """(micro-batches, rows, ...) arrays with their rows split over the mesh's devices; over several processes
        each gives its own rows, which make the global batch in process order."""
        if self.mesh is None or tree is None:
            return tree
        sharding = NamedSharding(self.mesh, PartitionSpec(None, tuple(self.mesh.axis_names)))
        if jax.process_count() > 1:
            return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)
        return jax.device_put(tree, sharding)

    # ---- the computation ----------------------------------------------------------------------------------
    def apply(self, params, trainable, dtype=None):
        """`params` with the trained weights put in (a full fine-tune's in `dtype`: the pipeline's by default)."""
        method = self.config.method
        if method == "full":
            return {**params, **jax.tree.map(lambda t: t.astype(dtype or self.pipeline.dtype), trainable)}
        if method == "lora":
            return merge_lora(params, lora_lib.with_alphas(trainable, self.alphas))
        params = dict(params)
        for name, rows in trainable.items():
            encoder = params[name]
            table = encoder["embeddings_token_embedding"]["embedding"]
            table = table.at[self.token_ids[name]].set(rows.astype(table.dtype))
            params[name] = {**encoder, "embeddings_token_embedding": {"embedding": table}}
        return params

    def _batch_loss(self, trainable, frozen, batch, draws):
        """The loss of one micro-batch (its rows as diffusers' scripts collate them)."""
        params = self.apply(frozen, trainable, self.compute_dtype)
        if "latents" in batch:
            latents = batch["latents"].astype(jnp.float32)
        else:
            latents = self.vae.encode(params, batch["pixel_values"], draws["latent_noise"])
        noise = draws["noise"] + self.config.noise_offset * draws["offset_noise"]
        timesteps = draws["timesteps"]
        noisy = self.schedule.add_noise(latents, noise, timesteps)
        if "prompt_embeds" in batch:  # the frozen encoders' states, computed once (sdflax train's cache)
            encoded = (batch["prompt_embeds"], batch["pooled_prompt_embeds"]) if self.sdxl else batch["prompt_embeds"]
        else:
            encoded = self.text.encode_prompt(params, batch["input_ids"])
        if self.sdxl:
            context, pooled = encoded
            time_ids = jnp.concatenate([jnp.asarray(batch[name], jnp.float32).reshape(latents.shape[0], -1)
                                        for name in SIZE_IDS], axis=-1)
            extra = {"text_embeds": pooled, "time_ids": time_ids}
        else:
            context, extra = encoded, {}
        prediction = self.unet.apply(params["unet"], noisy.astype(self.compute_dtype), timesteps,
                                     context.astype(self.compute_dtype), **extra)
        prior = self.config.prior_loss_weight if self.config.with_prior_preservation else None
        return denoising_loss(prediction, self.schedule.target(latents, noise, timesteps), timesteps, self.schedule,
                              self.config.snr_gamma, prior)

    def _draws(self, key, batch, given):
        """Each micro-batch's noise, timesteps, per-channel offset noise and VAE posterior noise: `given` ones as
        they are, the others from `key`."""
        shape = self._latent_shape(batch)
        keys = jax.random.split(key, 4)
        draws = {
            "noise": lambda k: jax.random.normal(k, shape, jnp.float32),
            "timesteps": lambda k: jax.random.randint(k, shape[:2], 0, self.schedule.num_train_timesteps),
            "offset_noise": lambda k: jax.random.normal(k, (*shape[:3], 1, 1), jnp.float32),
            "latent_noise": lambda k: jax.random.normal(k, shape, jnp.float32),
        }
        return {name: given[name] if given.get(name) is not None else draw(k)
                for (name, draw), k in zip(draws.items(), keys)}

    def _latent_shape(self, batch):
        """(micro-batches, rows, C, h, w) of the latents."""
        if "latents" in batch:
            return batch["latents"].shape
        *lead, _, height, width = batch["pixel_values"].shape
        factor = self.pipeline.vae_scale_factor
        return (*lead, self.pipeline.vae.config.latent_channels, height // factor, width // factor)

    def _mean_loss(self, trainable, frozen, batch, given, key):
        draws = self._draws(key, batch, given)

        def micro(total, xs):
            return total + self._batch_loss(trainable, frozen, *xs), None

        total, _ = jax.lax.scan(micro, jnp.zeros((), jnp.float32), (batch, draws))
        return total / self.config.gradient_accumulation_steps

    def _update(self, state: TrainState, frozen, batch, given):
        key, step_key = jax.random.split(state.key)
        scale = state.loss_scale
        if scale is None:
            loss, grads = jax.value_and_grad(self._mean_loss)(state.trainable, frozen, batch, given, step_key)
        else:  # float16: GradScaler's scaled loss, then the gradients unscaled by its reciprocal, as torch does
            def scaled(trainable):
                loss = self._mean_loss(trainable, frozen, batch, given, step_key)
                return loss * scale.scale, loss

            (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(state.trainable)
            grads = jax.tree.map(lambda g: g * (1.0 / scale.scale), grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        applied = state.step  # updates applied so far: the learning-rate schedule's count
        if scale is not None:  # an update whose gradients overflowed is skipped, and the scale halved
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
            trainable, opt_state = keep(trainable, state.trainable), keep(opt_state, state.opt_state)
            applied = state.step - scale.skipped
            scale = scale.after(finite)
        step = state.step + 1
        ema = None if state.ema is None else ema_update(state.ema, trainable, ema_decay_at(self.config, step))
        return (TrainState(step=step, trainable=trainable, opt_state=opt_state, ema=ema, key=key, loss_scale=scale),
                {"loss": loss, "learning_rate": self.learning_rate(applied)})

    # ---- the public calls ---------------------------------------------------------------------------------
    def _inputs(self, batch, noise, timesteps, offset_noise, latent_noise):
        """(batch, given draws) as arrays of (micro-batches, rows, ...)."""
        k = self.config.gradient_accumulation_steps
        batch = dict(batch)
        if ("latents" in batch) == ("pixel_values" in batch):
            raise ValueError("a training batch has latents (already scaled by the VAE's factor) or pixel_values "
                             "(B, 3, H, W) in [-1, 1], one of the two")
        embeds = ("prompt_embeds", "pooled_prompt_embeds")[:2 if self.sdxl else 1]
        if "input_ids" not in batch and not all(name in batch for name in embeds):
            raise ValueError("a training batch needs input_ids (pipeline.prepare_inputs(captions)) or the text "
                             f"encoders' states: {' and '.join(embeds)}")
        if "prompt_embeds" in batch and (self.config.train_text_encoder or self.config.method == "textual_inversion"):
            raise ValueError("prompt_embeds are for frozen text encoders: this training changes them, give input_ids")
        if self.sdxl:
            rows = len(batch.get("input_ids", batch.get("prompt_embeds")))
            for name in SIZE_IDS:
                if name not in batch:
                    raise ValueError(f"an SDXL training batch needs {name} per row (B, 2): "
                                     "original_size, crops_coords_top_left and target_size")
                batch[name] = np.broadcast_to(np.asarray(batch[name], np.float32), (rows, 2))
        rows = {name: len(value) for name, value in batch.items()}
        if len(set(rows.values())) != 1 or next(iter(rows.values())) % k:
            raise ValueError(f"the batch's rows {rows} must agree and divide into gradient_accumulation_steps={k} "
                             "micro-batches")
        n = next(iter(rows.values()))
        if self.config.with_prior_preservation and (n * jax.process_count() // k) % 2:  # of the global batch
            raise ValueError(f"with_prior_preservation: each micro-batch is [instance rows; class rows], an even "
                             f"number of rows; got {n // k}")
        split = lambda x: None if x is None else np.asarray(x).reshape(k, n // k, *np.shape(x)[1:])  # noqa: E731
        if offset_noise is not None:
            offset_noise = np.asarray(offset_noise, np.float32).reshape(n, -1, 1, 1)
        given = {"noise": split(noise), "timesteps": split(None if timesteps is None else
                                                           np.asarray(timesteps, np.int32)),
                 "offset_noise": split(offset_noise), "latent_noise": split(latent_noise)}
        return self._place({name: split(value) for name, value in batch.items()}), self._place(given)

    def loss(self, batch, noise=None, timesteps=None, offset_noise=None, latent_noise=None):
        """The loss of `batch` at the current weights, without an update (the draws not given come from the
        trainer's key, which this does not advance)."""
        batch, given = self._inputs(batch, noise, timesteps, offset_noise, latent_noise)
        return self._loss(self.state.trainable, self.frozen, batch, given, self.state.key)

    def step(self, batch, noise=None, timesteps=None, offset_noise=None, latent_noise=None) -> dict:
        """One optimizer update on `batch` (a dict: "latents" or "pixel_values", "input_ids"; SDXL's size ids; all
        gradient_accumulation_steps micro-batches, one after the other) -> {"loss", "learning_rate"}. `noise`
        (B, C, h, w), `timesteps` (B,), `offset_noise` (B, C) and, for pixel_values, `latent_noise` (B, C, h, w:
        the VAE posterior's sample is mean + std * latent_noise) given make the update reproducible elsewhere."""
        batch, given = self._inputs(batch, noise, timesteps, offset_noise, latent_noise)
        self.state, metrics = self._step(self.state, self.frozen, batch, given)
        return metrics

    @property
    def params(self):
        """The pipeline's params with the training applied (the EMA weights with use_ema): sample with
        `trainer.pipeline(ids, trainer.params, key)`."""
        trained = self.state.ema if self.config.use_ema else self.state.trainable
        if self.mesh is not None:  # sharded over the mesh; the params are where the pipeline put them
            trained = _gathered(trained)
        return self.apply(self.base_params, trained)

    # ---- files --------------------------------------------------------------------------------------------
    def save_lora(self, path, format="diffusers", overwrite=False):
        """The trained LoRA as a .safetensors file: "diffusers" (PEFT's names, for load_lora_weights) or "kohya"
        (A1111, ComfyUI). sdflax reads both (`pipeline.load_lora`)."""
        if self.config.method != "lora":
            raise ValueError(f"save_lora: this trainer trains method={self.config.method!r}, not a LoRA")
        trained = _gathered(self.state.ema if self.config.use_ema else self.state.trainable)
        if jax.process_index() != 0:  # every process gathers, the first writes
            return
        lora_lib.save_lora(path, trained, self.alphas, format, self.sdxl, self.lora_targets, overwrite)

    def save_embedding(self, path, format="diffusers", overwrite=False):
        """The learned token as a file: diffusers' learned_embeds.safetensors ({token: (n, D)}), or A1111's
        ({"emb_params": (n, D)}; SDXL: {"clip_l", "clip_g"}) with format="a1111"."""
        if self.config.method != "textual_inversion":
            raise ValueError(f"save_embedding: this trainer trains method={self.config.method!r}, not an embedding")
        rows = {name: np.asarray(v, np.float32) for name, v in
                _gathered(self.state.ema if self.config.use_ema else self.state.trainable).items()}
        if jax.process_index() != 0:
            return
        if self.sdxl:
            tensors = {"clip_l": rows["text_encoder"], "clip_g": rows["text_encoder_2"]}
        elif format == "a1111":
            tensors = {"emb_params": rows["text_encoder"]}
        elif format == "diffusers":
            tensors = {self.config.placeholder_token: rows["text_encoder"]}
        else:
            raise ValueError(f"save_embedding: format={format!r}; choose 'diffusers' or 'a1111'")
        write_safetensors(path, tensors, {"format": "pt"}, overwrite=overwrite)

    def save_pretrained(self, folder, base, revision=None):
        """The trained pipeline as a diffusers folder (`trainer.params`: the EMA weights with use_ema, a LoRA
        merged): `base`'s configs, tokenizers and scheduler, where `base` is the folder or hub id the pipeline was
        loaded from, with every model's weights. diffusers' and sdflax's `from_pretrained` load it."""
        if self.config.method == "textual_inversion":
            raise ValueError("save_pretrained: a textual inversion's result is its embedding: save_embedding(path) "
                             "(pipeline.load_textual_inversion loads it)")
        params = jax.device_get(self.params)
        if jax.process_index() == 0:
            save_pretrained(folder, base, params, revision)

    def save_checkpoint(self, folder, overwrite=False):
        """The whole training state (trained weights, optimizer state, EMA, step, key) in `folder`, written beside
        it and renamed into place, so a killed save leaves no folder that loads. `restore_checkpoint` reads it.
        Over several processes every one calls it (the sharded state is gathered) and the first writes."""
        folder = os.fspath(folder)
        arrays = _flat_state(self.state)
        if jax.process_index() != 0:
            return
        if os.path.lexists(folder) and not overwrite:
            raise FileExistsError(f"{folder} exists: choose another folder, or pass overwrite=True")
        staging = f"{folder}.partial-{os.getpid()}"
        os.makedirs(staging)
        write_safetensors(os.path.join(staging, "state.safetensors"), arrays)
        info = {"version": CHECKPOINT_VERSION, "step": int(self.state.step), "config": _jsonable(self.config)}
        with open(os.path.join(staging, "trainer.json"), "w") as f:
            json.dump(info, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.lexists(folder):  # overwrite: the old one goes only once the new one is complete
            old = f"{folder}.old-{os.getpid()}"
            os.rename(folder, old)
            os.rename(staging, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, folder)
        fsync_folder(os.path.dirname(os.path.abspath(folder)))

    def restore_checkpoint(self, folder):
        """The training state `save_checkpoint` wrote, bit for bit; the trainer must be made as the saving one
        was (the same pipeline, config and method)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(self.state)
        if jax.process_index() == 0:
            arrays = self._read_checkpoint(os.fspath(folder), leaves)
        else:  # the first process's files, wherever its --out is
            arrays = [np.zeros(leaf.shape, leaf.dtype) for _, leaf in leaves]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            arrays = [np.asarray(a) for a in multihost_utils.broadcast_one_to_all(arrays)]
        state = jax.tree_util.tree_unflatten(treedef, arrays)
        self.state = jax.tree.map(jnp.array, state) if self.mesh is None else jax.device_put(
            state, self._shardings(state))

    def _read_checkpoint(self, folder, leaves) -> list:
        """The state's arrays from a checkpoint folder, checked against this trainer's (`leaves`)."""
        info_path, state_path = os.path.join(folder, "trainer.json"), os.path.join(folder, "state.safetensors")
        if not (os.path.isfile(info_path) and os.path.isfile(state_path)):
            raise FileNotFoundError(f"{folder} is not a training checkpoint (it needs trainer.json and "
                                    "state.safetensors, as Trainer.save_checkpoint writes them)")
        with open(info_path) as f:
            info = json.load(f)
        if info.get("config") != _jsonable(self.config):
            changed = sorted(k for k in _jsonable(self.config) if info.get("config", {}).get(k) !=
                             _jsonable(self.config)[k])
            raise ValueError(f"{folder} was saved by a trainer with other settings ({', '.join(changed[:5])}): "
                             "restore it into a trainer made with the same TrainConfig")
        stored = read_safetensors(state_path)
        names = [jax.tree_util.keystr(path) for path, _ in leaves]
        if sorted(stored) != sorted(names):
            raise ValueError(f"{folder} holds another training state (its arrays differ from this trainer's): "
                             "restore it into a trainer made as the saving one was")
        arrays = []
        for name, (_, leaf) in zip(names, leaves):
            value = stored[name]
            if value.shape != leaf.shape or value.dtype != leaf.dtype:
                raise ValueError(f"{folder}: {name} is {value.dtype}{list(value.shape)}, this trainer's "
                                 f"{leaf.dtype}{list(leaf.shape)}")
            arrays.append(np.array(value))
        return arrays


def _gathered(tree):
    """Host copies of arrays, whole even where they are sharded over other processes' devices."""
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda x: np.asarray(jax.device_get(x) if x.is_fully_addressable else
                                             multihost_utils.process_allgather(x, tiled=True)), tree)


def _flat_state(state) -> dict:
    leaves, _ = jax.tree_util.tree_flatten_with_path(_gathered(state))
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _jsonable(config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config)))


def _add_placeholder(pipeline, params, config, encoders):
    """(pipeline, params, {encoder: new ids}, {encoder: rows}) with the placeholder token(s) added to the
    tokenizer(s) and the text encoders' tables grown by rows that start as the initializer token's embedding, as
    diffusers' textual_inversion.py does."""
    tokens = [config.placeholder_token] + [f"{config.placeholder_token}_{i}" for i in range(1, config.num_vectors)]
    parts, params, ids, rows = {}, dict(params), {}, {}
    for encoder in encoders:
        tokenizer_name = encoder.replace("text_encoder", "tokenizer")
        tokenizer = copy.deepcopy(getattr(pipeline, tokenizer_name))
        if any(token in tokenizer.get_vocab() for token in tokens) or tokenizer.add_tokens(tokens) != len(tokens):
            raise ValueError(f"the tokenizer already has {config.placeholder_token!r}: choose another "
                             "placeholder_token")
        initializer = tokenizer.tokenize(config.initializer_token)
        if len(initializer) != 1:
            raise ValueError(f"initializer_token {config.initializer_token!r} is {len(initializer)} tokens "
                             f"({initializer}); it must be one token")
        token_ids = np.asarray(tokenizer.convert_tokens_to_ids(tokens))
        table = params[encoder]["embeddings_token_embedding"]["embedding"]
        start = np.repeat(np.asarray(table[tokenizer.convert_tokens_to_ids(initializer[0])], np.float32)[None],
                          len(tokens), axis=0)
        parts[encoder], params[encoder] = add_rows(getattr(pipeline, encoder), params[encoder], token_ids, start)
        parts[tokenizer_name], ids[encoder], rows[encoder] = tokenizer, token_ids, start
    return pipeline.replace(**parts), params, ids, rows
