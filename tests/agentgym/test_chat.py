"""Incremental conversation building matches the template's own full rendering."""

import pytest
from transformers import AutoTokenizer

from agentgym.chat import ChatFormatter


@pytest.fixture(params=["chatml", "llama3"])
def tokenizer(request, tiny_path, tiny_llama3_path):
    return AutoTokenizer.from_pretrained(tiny_path if request.param == "chatml" else tiny_llama3_path)


def _conversation(fmt: ChatFormatter, system, turns, end_with_eot: bool):
    """Build ids incrementally; replies are 'sampled' as ids (never re-encoded with context)."""
    tok = fmt.tokenizer
    ids = fmt.start(system, turns[0][0])
    mask = [0] * len(ids)
    for k, (_, reply) in enumerate(turns):
        reply_ids = tok(reply, add_special_tokens=False)["input_ids"]
        if end_with_eot:
            reply_ids = reply_ids + [fmt.end_of_turn_ids[0]]
        ids += reply_ids
        mask += [1] * len(reply_ids)
        if k + 1 < len(turns):
            glue = fmt.glue(turns[k + 1][0], fmt.ends_turn(reply_ids))
            ids += glue
            mask += [0] * len(glue)
    return ids, mask


def test_two_templates_differ(tiny_path, tiny_llama3_path):
    a = ChatFormatter(AutoTokenizer.from_pretrained(tiny_path)).start("sys", "hello")
    b = ChatFormatter(AutoTokenizer.from_pretrained(tiny_llama3_path)).start("sys", "hello")
    assert a != b


@pytest.mark.parametrize("system", [None, "You are an agent."])
def test_incremental_text_equals_full_render(tokenizer, system):
    fmt = ChatFormatter(tokenizer)
    turns = [("go to the red ball", "Action: go forward"), ("You see a wall.", "Action: turn left"),
             ("Done?", "Action: pickup red ball")]
    ids, mask = _conversation(fmt, system, turns, end_with_eot=True)
    messages = ([{"role": "system", "content": system}] if system else [])
    for obs, reply in turns:
        messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": reply}]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    built = tokenizer.decode(ids, skip_special_tokens=False)
    # the full render closes the last assistant turn with the template suffix; ours stops at EOT
    suffix_rest = fmt.assistant_suffix[len(tokenizer.convert_ids_to_tokens(fmt.end_of_turn_ids[0])):]
    assert built + suffix_rest == full


def test_mask_covers_exactly_the_replies(tokenizer):
    fmt = ChatFormatter(tokenizer)
    turns = [("obs one", "reply one"), ("obs two", "reply two")]
    ids, mask = _conversation(fmt, None, turns, end_with_eot=False)
    sampled = [t for t, m in zip(ids, mask) if m]
    expected = sum((tokenizer(r, add_special_tokens=False)["input_ids"] for _, r in turns), [])
    assert sampled == expected


def test_cut_reply_gets_full_suffix(tokenizer):
    fmt = ChatFormatter(tokenizer)
    with_eot = fmt.glue("next", reply_ended_turn=True)
    without = fmt.glue("next", reply_ended_turn=False)
    assert len(without) > len(with_eot)
    assert tokenizer.decode(without, skip_special_tokens=False).startswith(
        tokenizer.convert_ids_to_tokens(fmt.end_of_turn_ids[0]))


def test_response_prefix_is_forced_and_reported(tokenizer):
    fmt = ChatFormatter(tokenizer, response_prefix="Action:")
    assert tokenizer.decode(fmt.start(None, "hi")).endswith("Action:")
    reply = tokenizer(" go", add_special_tokens=False)["input_ids"]
    assert fmt.reply_text(reply + [fmt.end_of_turn_ids[0]]) == "Action: go"


def test_tokenizer_without_template_is_rejected(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatFormatter(tok)
