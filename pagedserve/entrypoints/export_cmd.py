"""`pagedserve export`: a model's weights written as a checkpoint transformers and other engines load whole
(models/hf_export.py), for a GGUF model whose converted directory keeps most of them as GGUF blocks."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    export = sub.add_parser("export", help="write a model (the default model's name, a .gguf file or a directory) as a "
                                           "safetensors checkpoint that transformers loads")
    export.add_argument("model", help="the default model's name, a .gguf file, or a model directory")
    export.add_argument("out_dir", type=Path, help="where to write it (made if absent)")
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pagedserve.models.hf_export import export_checkpoint
    from pagedserve.models.location import resolve_model_dir

    if args.out_dir.exists() and any(args.out_dir.iterdir()):
        raise ValueError(f"out_dir {args.out_dir} is not empty")
    print(export_checkpoint(resolve_model_dir(args.model), args.out_dir))
    return 0
