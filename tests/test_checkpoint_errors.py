"""Broken checkpoints give one clear line that names the problem, on both backends, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")

from exactspec.cli import main
from exactspec.loading import default_pair_dirs


def broken_copy(tmp_path, name: str):
    path = tmp_path / name
    shutil.copytree(default_pair_dirs()[0], path)
    return path


def edit_config(path, change) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def invalid_json(path):
    (path / "config.json").write_text("{not json")
    return f"{path / 'config.json'} is not valid JSON"


def missing_field(path):
    edit_config(path, lambda c: c.pop("hidden_size"))
    return {
        "lean": f"{path / 'config.json'}: config lacks the required field(s) 'hidden_size'",
        "hf": f"transformers cannot use {path / 'config.json'}",
    }


def truncated_weights(path):
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    return {"lean": f"cannot read {weights}", "hf": f"transformers cannot load the weights in {path}"}


def wrong_shapes(path):
    edit_config(path, lambda c: c.update(intermediate_size=100))
    return {
        "lean": f"{path / 'model.safetensors'}: a weight does not match the shapes its config describes",
        "hf": f"transformers cannot load the weights in {path}",
    }


def missing_tokenizer(path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink()
    return f"{path} has no tokenizer.json and transformers found no other usable tokenizer there"


def unreadable_tokenizer(path):
    (path / "tokenizer.json").write_text("garbage")
    return f"{path / 'tokenizer.json'} is not a readable tokenizer"


def missing_shard(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    (path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.norm.weight": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    return {
        "lean": f"lists model-00002-of-00002.safetensors, which is not in {path}",
        "hf": f"transformers cannot load the weights in {path}",
    }


def not_llama(path):
    edit_config(path, lambda c: c.update(model_type="gpt2"))
    return {"lean": "expected a Llama checkpoint (model_type 'llama'), got model_type 'gpt2'"}


BREAKAGES = [
    invalid_json,
    missing_field,
    truncated_weights,
    wrong_shapes,
    missing_tokenizer,
    unreadable_tokenizer,
    missing_shard,
    not_llama,
]


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda b: b.__name__)
@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_a_broken_checkpoint_is_one_line_naming_the_problem(tmp_path, capsys, breakage, backend):
    path = broken_copy(tmp_path, "target")
    expected = breakage(path)
    message = expected if isinstance(expected, str) else expected.get(backend)
    if message is None:
        pytest.skip(f"{breakage.__name__} is not an error for the {backend} backend")
    code = main(
        ["generate", "x", "--target", str(path), "--no-speculation", "--backend", backend, "--max-new-tokens", "2"]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1 and err.startswith("exactspec: error:"), err
