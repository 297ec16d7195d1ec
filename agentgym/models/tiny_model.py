"""The tiny test model: a ~0.15M-parameter ``Qwen2ForCausalLM`` with random weights and a
byte-level BPE tokenizer trained locally (seconds) on a built-in corpus, with a ChatML
(``tiny``) or Llama-3-style (``tiny-llama3``) chat template, so code that must not assume
ChatML is tested against a second, genuinely different template.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import cast

from agentgym.models.cache import DEFAULT_CACHE, cache_root, publish, staging

# Bumped whenever the output of build_tiny_model changes, so stale cache folders are not reused.
_TINY_VERSION = 1

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
    eot_id = cast(int, tokenizer.convert_tokens_to_ids(eot))  # one token: one id
    pad_id = cast(int, tokenizer.convert_tokens_to_ids("<|endoftext|>"))

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
    root = cache_root(cache_dir)
    final = root / f"tiny-{template}-v{_TINY_VERSION}"
    if (final / "config.json").exists():
        return final
    with staging(final) as tmp:
        build_tiny_model(tmp, template=template)
        return publish(tmp, final)
