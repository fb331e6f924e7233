"""Checkpoints -> modules and params: everything that reads files, and nothing else does.

- `hub`: a model id or local folder -> files on disk (huggingface_hub, offline rules, one-line errors);
- `files`: safetensors (memory-mapped), PyTorch .bin (a restricted unpickler), Flax msgpack -> numpy tensors;
- `weights`: checkpoint tensors -> a params pytree by a name table; `ldm_names`: the CompVis / SGM / OpenCLIP /
  ControlNet / SD 3 name tables of single files and LoRAs;
- `assemble`: the one assembly path, models from configs with params filled from a source's tensors;
- `folders`: diffusers folders (which files to fetch, the folder check, tokenizers, the scheduler);
  `single_file`: CompVis / A1111 / SGM / Stability files;
- `lora`, `embeddings` (textual inversion), `ip_adapter`: the files that change a loaded pipeline, pure;
- `tokenizers`: CLIP's and T5's tokenizers without transformers.

Importing this package imports none of them: each is imported where it is used.
"""
