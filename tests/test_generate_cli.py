"""`exactspec generate` on local checkpoints: streaming, summary, options, one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from conftest import save_tiny_checkpoint, tiny_tokenizer_json

from exactspec.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tokenizer = tiny_tokenizer_json()
    target = save_tiny_checkpoint(root / "target", vocab_rows=300, layers=2, seed=0, tokenizer_json=tokenizer)
    draft = save_tiny_checkpoint(root / "draft", vocab_rows=320, layers=1, seed=1, tokenizer_json=tokenizer)  # padded
    return target, draft


def generate(capsys, *args):
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_streams_text_and_ends_with_a_one_line_summary(pair, capsys):
    target, draft = pair
    code, out, err = generate(
        capsys,
        "def parse_args(",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--max-new-tokens",
        "12",
        "--ignore-eos",
    )
    assert code == 0 and out.strip()
    assert (
        err.count("\n") == 1
        and "12 tokens" in err
        and "tokens/s" in err
        and "acceptance" in err
        and "tokens/round" in err
    )


def test_json_output_and_greedy_equals_plain_across_backends(pair, capsys):
    target, draft = pair
    common = [
        "import os",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--json",
        "--dtype",
        "float32",
    ]
    texts = []
    for extra in ([], ["--no-speculation"], ["--backend", "hf"], ["--backend", "hf", "--gamma", "2"]):
        code, out, _ = generate(capsys, *common, *extra)
        result = json.loads(out)
        assert code == 0 and result["tokens"] == 16
        texts.append(result["text"])
    assert len(set(texts)) == 1


def test_a_seed_reproduces_a_stochastic_run(pair, capsys):
    target, draft = pair
    args = [
        "x = ",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--max-new-tokens",
        "20",
        "--ignore-eos",
        "--json",
        "--top-p",
        "0.9",
        "--gamma",
        "3",
    ]
    first = json.loads(generate(capsys, *args, "--seed", "3")[1])["text"]
    again = json.loads(generate(capsys, *args, "--seed", "3")[1])["text"]
    other = json.loads(generate(capsys, *args, "--seed", "4")[1])["text"]
    assert first == again and first != other


def test_verify_names_the_rule_and_json_compares_both_on_the_same_rounds(pair, capsys):
    """--verify block (default) and token: the rounds report the rule they ran, and both rules' expected tokens
    per round come from the same drafts. Which rule's is higher over one run's few rounds depends on the drafts
    drawn (the block rule wins averaged over drafts, not draft by draft: test_block enumerates that), so here: at
    gamma 3 the two differ and lie in [1, 4]; at gamma 1, where the rules coincide, they are equal."""
    target, draft = pair
    args = ["x = ", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "40", "--ignore-eos", "--json"]
    block = json.loads(generate(capsys, *args, "--gamma", "3")[1])
    token = json.loads(generate(capsys, *args, "--gamma", "3", "--verify", "token")[1])
    assert block["verify"] == ["block"] and token["verify"] == ["token"] and block["verify_rule"] == "block"
    for result in (block, token):
        expected = result["expected_tokens_per_round"]
        assert expected["rounds"] > 3 and expected["token"] != expected["block"]
        assert 1 <= min(expected["token"], expected["block"]) and max(expected["token"], expected["block"]) <= 4
    single = json.loads(generate(capsys, *args, "--gamma", "1")[1])["expected_tokens_per_round"]
    assert (
        single["rounds"] > 3
        and single["token"] == pytest.approx(single["block"], abs=1e-9)
        and 1 <= single["token"] <= 2
    )
    code, _, err = generate(capsys, *args, "--verify", "blocks")
    assert code == 2 and "invalid choice" in err


def test_errors_are_one_line_with_exit_code_2(pair, capsys, tmp_path):
    target, draft = pair
    mismatched = tmp_path / "other"
    shutil.copytree(draft, mismatched)
    (mismatched / "tokenizer.json").write_text(tiny_tokenizer_json(extra_text="class Zebra:\n    pass\n" * 5))
    cases = [
        (["--target", str(tmp_path / "absent"), "--draft", str(draft)], "model directory not found"),
        (["--target", str(target), "--draft", str(tmp_path / "absent")], f"draft not found: {tmp_path / 'absent'}"),
        (["--target", str(target), "--draft", str(mismatched)], "tokenizers differ at"),
        (["--draft", str(draft)], "--draft needs --target"),
        (["--target", str(target), "--draft", str(draft), "--top-p", "0"], "--top-p must be in"),
        (
            ["--target", str(target), "--draft", str(draft), "--max-new-tokens", "1000"],
            "exceeds the target model's 256 positions",
        ),
        (["--target", str(target), "--draft", str(draft), "--backend", "vllm"], "invalid choice"),
    ]
    for args, message in cases:
        code, out, err = generate(capsys, "def f(", *args)
        assert code == 2 and message in err and err.count("\n") == 1 and out == "", (args, err)


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_max_new_tokens_may_fill_the_window_exactly_on_both_backends(pair, capsys, backend):
    """The last generated token is never fed to a model, and drafts never run past the budget: prompt +
    max_new_tokens - 1 positions are needed, with or without speculation; one more is a one-line error."""
    from exactspec.tokenizer import TextTokenizer

    target, draft = pair
    prompt_length = len(TextTokenizer.from_dir(target).encode_prompt("def f("))
    fits = str(256 - prompt_length + 1)
    common = ["def f(", "--target", str(target), "--draft", str(draft), "--backend", backend, "--ignore-eos", "--json"]
    for extra in (["--no-speculation"], ["--gamma", "4"], []):
        code, out, err = generate(capsys, *common, *extra, "--max-new-tokens", fits)
        assert code == 0 and json.loads(out)["tokens"] == int(fits), (extra, err)
    code, out, err = generate(capsys, *common, "--no-speculation", "--max-new-tokens", str(int(fits) + 1))
    assert code == 2 and "exceeds the target model's 256 positions" in err and err.count("\n") == 1


def test_a_hub_id_is_read_from_the_local_hugging_face_cache_and_never_downloaded(pair, capsys, tmp_path, monkeypatch):
    target, draft = pair
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(target, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = generate(
        capsys,
        "def f(",
        "--target",
        "tiny-org/tiny-llama",
        "--no-speculation",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--json",
    )
    assert code == 0 and json.loads(out)["tokens"] == 4, err
    code, out, err = generate(capsys, "def f(", "--target", "tiny-org/absent", "--draft", str(draft))
    assert (
        code == 2
        and err.count("\n") == 1
        and "never downloads" in err
        and "huggingface-cli download tiny-org/absent" in err
    )


def test_a_target_without_a_draft_speculates_by_prompt_lookup(pair, capsys):
    target, _ = pair
    for args in (["--target", str(target)], ["--target", str(target), "--draft", "lookup"]):
        record = json.loads(
            generate(capsys, "def f(x):\n    return x\n", *args, "--json", "--max-new-tokens", "16", "--ignore-eos")[1]
        )
        assert record["mode"].startswith("speculative (prompt lookup)") and record["tokens"] == 16


def test_threads_default_to_one_for_a_small_target_and_follow_the_flag(pair, capsys):
    target, draft = pair
    before = torch.get_num_threads()
    try:
        for flags, expected in (([], 1), (["--threads", "2"], 2)):
            record = json.loads(
                generate(
                    capsys,
                    "def f(",
                    "--target",
                    str(target),
                    "--draft",
                    str(draft),
                    "--json",
                    "--max-new-tokens",
                    "4",
                    *flags,
                )[1]
            )
            assert record["threads"] == expected
    finally:
        torch.set_num_threads(before)


def test_device_is_checked_before_loading(pair, capsys):
    target, draft = pair
    code, _, err = generate(capsys, "x", "--target", str(target), "--draft", str(draft), "--device", "nosuch")
    assert code == 2 and "unknown device 'nosuch'" in err and err.count("\n") == 1
    if not torch.cuda.is_available():
        code, _, err = generate(capsys, "x", "--target", str(target), "--draft", str(draft), "--device", "cuda")
        assert code == 2 and "device cuda is not available" in err and err.count("\n") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generate_on_cuda_matches_cpu_greedy(pair, capsys):
    """The same float32 greedy tokens on the GPU as on the CPU (the tiny pair has no near-ties at this length)."""
    target, draft = pair
    runs = [
        json.loads(
            generate(
                capsys,
                "def f(",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--json",
                "--temperature",
                "0",
                "--dtype",
                "float32",
                "--max-new-tokens",
                "16",
                "--ignore-eos",
                "--device",
                device,
            )[1]
        )
        for device in ("cpu", "cuda")
    ]
    assert runs[0]["text"] == runs[1]["text"]


def test_download_fetches_a_missing_hub_id_only_when_asked(pair, capsys, monkeypatch, tmp_path):
    """--download hands a hub id missing from the cache to huggingface_hub (replaced here: tests stay offline);
    without it nothing is fetched; a failed download is one line."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    target, _ = pair
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    fetched = []

    def fake_snapshot_download(repo_id, cache_dir):
        fetched.append(repo_id)
        if repo_id == "tiny-org/offline":
            raise OSError("We couldn't connect to 'https://huggingface.co'")
        destination = tmp_path / "hub" / "fetched"
        shutil.copytree(target, destination)
        return str(destination)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    code, _, err = generate(capsys, "def f(", "--target", "tiny-org/tiny", "--no-speculation", "--max-new-tokens", "2")
    assert code == 2 and "pass --download" in err and fetched == []
    code, out, err = generate(
        capsys,
        "def f(",
        "--target",
        "tiny-org/tiny",
        "--download",
        "--no-speculation",
        "--max-new-tokens",
        "2",
        "--json",
    )
    assert code == 0 and json.loads(out)["tokens"] == 2 and fetched == ["tiny-org/tiny"], err
    code, _, err = generate(capsys, "def f(", "--target", "tiny-org/offline", "--download", "--no-speculation")
    assert code == 2 and err.count("\n") == 1 and "could not download tiny-org/offline" in err
