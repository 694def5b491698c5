"""Chat templates: each family's documented format and its thinking switch."""

import pytest

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
