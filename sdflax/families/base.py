"""`Family`: everything the rest of sdflax asks about a model family, as one value.

A family names its text conditioning piece (which carries its components' classes, its tokenizers, its denoiser
and how prompts become what the denoiser sees: `pipeline/text.py`), the `model_index.json` class names of its
checkpoints, its public pipeline classes (rows of the table: start x wrappers, argument order, defaults) and the
command-line flags it adds. `sdflax.families.register` makes a family defined anywhere, a user's own module
included, known to `Pipeline.from_pretrained`, the table and the command line.
"""

from __future__ import annotations

import dataclasses
import functools

from ..pipeline.table import START_NAMES, Row, make_class


@dataclasses.dataclass(frozen=True, eq=False)  # a family is itself: compared and hashed by identity
class Family:
    name: str  # the key the table and the command line know it by: "sd", "sdxl", "sd3"
    title: str  # in messages: "SD 1.x / 2.x"
    text: type  # the text conditioning piece (`pipeline.text.SDText`'s shape): components, tokenizers, denoiser
    class_names: tuple  # prefixes of model_index.json's `_class_name` for its checkpoints: "StableDiffusionXL"
    rows: dict  # its public classes: name -> `pipeline.table.Row`
    flags: tuple = ()  # (flag, Request field) pairs of the command line that only this family takes
    single_file: str | None = None  # "module:name" of the layout its single files are read by (loading)
    module: str = __name__  # where its classes live, for their repr and pickling
    # the module of its command-line side: the checkpoint parts the checks read, its denoiser's config and the
    # request's checks against it, the output size's step (`sdflax/cli/unet.py`'s functions)
    cli: str = "sdflax.cli.unet"

    @functools.cached_property
    def classes(self) -> dict:
        """The public classes of its rows, made once."""
        return {name: make_class(name, row, self) for name, row in self.rows.items()}

    def pipeline_class(self, start: str = "noise", controlnet: bool = False, class_name: str | None = None) -> type:
        """The class of a cell: start "noise", "image" or "image_mask", with or without ControlNets; a checkpoint
        made for one pipeline of its own (`class_name`, its model_index.json's: Flux Fill, Flux Control) gets that
        one."""
        from ..pipeline.controlnet import ControlNet
        from ..pipeline.t2i_adapter import T2IAdapters

        own = self.classes.get((class_name or "").removesuffix("Pipeline"))
        if own is not None and (own.start not in START_NAMES or not all(
                issubclass(wrapper, (ControlNet, T2IAdapters)) for wrapper in own.wrappers)):
            return own  # a start or a piece no other cell has: its transformer needs them (Fill, Control)
        for cls in self.classes.values():
            controlled = any(issubclass(wrapper, ControlNet) for wrapper in cls.wrappers)  # SD 3.x's piece too
            if START_NAMES.get(cls.start) == start and controlled == controlnet \
                    and T2IAdapters not in cls.wrappers:
                return cls
        raise ValueError(f"no {self.title} pipeline for start={start!r}, controlnet={controlnet}")

    @property
    def flow(self) -> bool:
        """Whether its denoiser predicts a flow's velocity (flow-matching schedulers) rather than ε or v."""
        return self.text.denoiser.flow

    @property
    def zeros_for_empty_negative(self) -> bool:
        """Whether no negative prompt is its own input (`force_zeros_for_empty_prompt`: SDXL), not the empty
        prompt's ids."""
        return "force_zeros_for_empty_prompt" in self.text.index_options

    def claims(self, class_name: str) -> int:
        """How long a prefix of `class_name` this family claims (0: none): the longest claim wins."""
        return max((len(prefix) for prefix in self.class_names if class_name.startswith(prefix)), default=0)


__all__ = ["Family", "Row"]
