"""Chat templates: each family's documented format and its thinking switch; the reasoning split."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mbd_jax import chat
from mbd_jax.errors import UserError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]


def test_qwen_template_and_thinking_switch():
    off = chat.render(MESSAGES, thinking=False, template="qwen")
    assert off == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                   "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = chat.render(MESSAGES, thinking=True, template="qwen")
    assert on == off[: -len("<think>\n\n</think>\n\n")]


def test_llada2_template_switches_thinking_in_the_system_prompt():
    off = chat.render(MESSAGES, thinking=False, template="llada2")
    assert off == ("<role>SYSTEM</role>detailed thinking off\nBe brief.<|role_end|>"
                   "<role>HUMAN</role>2+2?<|role_end|><role>ASSISTANT</role>4<|role_end|>"
                   "<role>HUMAN</role>3+3?<|role_end|><role>ASSISTANT</role>")
    on = chat.render(MESSAGES[1:], thinking=True, template="llada2")
    assert on.startswith("<role>SYSTEM</role>detailed thinking on<|role_end|><role>HUMAN</role>")


def test_plain_template_and_errors():
    assert chat.render([{"role": "user", "content": "hi"}], True) == "<|user|> hi\n<|assistant|> <think>"
    with pytest.raises(UserError, match=r"messages\[0\].role: must be one of"):
        chat.render([{"role": "robot", "content": "x"}])
    with pytest.raises(UserError, match=r"messages\[1\].content: must be a string"):
        chat.render([{"role": "user", "content": "x"}, {"role": "user", "content": 3}])


def test_developer_is_rendered_as_system():
    dev = [{"role": "developer", "content": "Be brief."}, *MESSAGES[1:]]
    for template in ("plain", "qwen", "llada2"):
        assert chat.render(dev, template=template) == chat.render(MESSAGES, template=template)


@given(st.text(alphabet="ab</think>\n ", max_size=40), st.lists(st.integers(1, 6), max_size=12))
def test_streamed_reasoning_split_equals_the_whole_text_split(text, cuts):
    """However the reply arrives in pieces, the streamed (reasoning, answer) deltas concatenate
    to split_reasoning of the whole reply."""
    stream, thought, answer, at = chat.ReasoningStream(), "", "", 0
    for n in cuts + [len(text)]:
        t, a = stream.push(text[at: at + n])
        thought, answer, at = thought + t, answer + a, at + n
    t, a = stream.finish()
    assert (thought + t, answer + a) == chat.split_reasoning(text)


def test_whitespace_opening_the_answer_is_dropped_in_whichever_delta_it_comes():
    """The falsifying case hypothesis found: the space after THINK_END arrived in a later delta
    than THINK_END itself and reached the answer stream."""
    stream = chat.ReasoningStream()
    pieces = [stream.push(p) for p in ("<<", "</think>", " ", "\n4", " 2")]
    assert "".join(a for _, a in pieces) == chat.split_reasoning("<<</think> \n4 2")[1] == "4 2"


def test_split_reasoning():
    assert chat.split_reasoning("plan </think>\n\n42") == ("plan ", "42")
    assert chat.split_reasoning("still thinking") == ("still thinking", "")


def test_a_model_directory_template_is_preferred_and_sandboxed(tmp_path):
    """tokenizer_config.json's chat_template (with the tokenizer's special tokens), overridden
    by chat_template.jinja; developer turns arrive as system; raise_exception is a UserError."""
    assert chat.for_model(tmp_path, "qwen").render(MESSAGES) == chat.render(MESSAGES, template="qwen")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "chat_template":
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% if enable_thinking %} <think>{% endif %}"
        "{% endif %}{{ extra | default('') }}"}))
    t = chat.for_model(tmp_path, "qwen")
    dev = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert t.render(dev) == "<s>[system] Be brief.\n[user] 2+2?\n[assistant]"
    assert t.render(dev, thinking=True, extra="!").endswith("[assistant] <think>!")
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}U")
    t = chat.for_model(tmp_path, "qwen")
    assert t.render(dev[1:]) == "U"
    with pytest.raises(UserError, match="refused them: user first"):
        t.render(dev)
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    with pytest.raises(UserError, match="chat template failed"):
        chat.for_model(tmp_path, "qwen").render(dev)
