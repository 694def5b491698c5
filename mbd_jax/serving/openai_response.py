"""One request's choices in the OpenAI shapes: the JSON body, and the chunks of its stream.

A request of `n` choices over several prompts runs as one scheduler Request per choice (choice
index = prompt * n + j). `Choices` turns their results, or their events as they arrive, into
`text_completion` / `chat.completion` objects: text or message (with `reasoning_content` split at
`</think>` in thinking mode; a chat's tool calls read out of the answer as `tool_calls`, streamed
as each call completes), finish reasons, per-token logprobs when asked, usage over all.
"""

from __future__ import annotations

import json
import time

from mbd_jax import chat
from mbd_jax.serving.logprobs import TokenLogprobs
from mbd_jax.serving.request import Request
from mbd_jax.serving.tool_use import ToolUse
from mbd_jax.tokenizer import Tokenizer
from mbd_jax.tool_calls import ToolCall


def finish_reason(result, called: bool = False) -> str:
    """OpenAI's finish reason; a reply that ended by itself after tool calls: "tool_calls"."""
    reason = {"stop": "stop", "length": "length", "max_nfe": "length"}.get(result.finish_reason,
                                                                            "stop")
    return "tool_calls" if called and reason == "stop" else reason


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def voting_info(result) -> dict:
    return {} if result.vote_scores is None else {
        "voting": {"answer": result.voted_answer, "final_answer": result.final_answer}}


class Choices:
    def __init__(self, reqs: list[Request], prompt_of: list[int], *, chat_format: bool,
                 thinking: bool, logprobs: bool, tokenizer: Tokenizer, model_name: str,
                 tools: ToolUse | None = None):
        self.reqs, self.prompt_of, self.chat = reqs, prompt_of, chat_format
        self.split = chat_format and thinking  # reasoning_content apart from the answer
        self.model_name = model_name
        self.created = int(time.time())
        self.kind = "chat.completion" if chat_format else "text_completion"
        self.logprobs = [TokenLogprobs(tokenizer, chat_format) if logprobs else None for _ in reqs]
        self.reasoning = [chat.ReasoningStream() for _ in reqs] if self.split else None
        self.tools = tools  # a chat's tool use (None: no tools)
        self.calls = [tools.stream() if tools else None for _ in reqs]  # per choice
        self.called = [0] * len(reqs)  # calls streamed per choice

    def usage(self, results: list) -> dict:
        """Each distinct prompt counted once, plus mbd-jax's decode forwards and tokens per
        forward."""
        first = {p: i for i, p in reversed(list(enumerate(self.prompt_of)))}  # a choice per prompt
        prompt = sum(results[i].prompt_tokens for i in first.values())
        cached = sum(self.reqs[i].cached_tokens for i in first.values())
        completion = sum(len(r.token_ids) for r in results)
        nfe = sum(r.nfe for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}, "nfe": nfe,
                "tokens_per_forward": round(sum(r.output_tokens for r in results) / max(nfe, 1), 4)}

    # ------------------------------------------------------------ the whole answer
    def body(self, results: list) -> dict:
        choices = []
        for i, result in enumerate(results):
            lp = self.logprobs[i] and self.logprobs[i].block(result.token_ids,
                                                              result.logprobs or [], last=True)
            choice = {"index": i, "finish_reason": finish_reason(result), "logprobs": lp,
                      **voting_info(result)}
            if self.chat:
                message = {"role": "assistant", "content": result.text}
                if self.split:
                    message["reasoning_content"], message["content"] = \
                        chat.split_reasoning(result.text)
                if self.tools is not None:
                    message["content"], calls = self.tools.reply(message["content"])
                    if calls:
                        message["tool_calls"] = [tool_call_json(c) for c in calls]
                        choice["finish_reason"] = finish_reason(result, called=True)
                choice["message"] = message
            else:
                choice["text"] = result.text
            choices.append(choice)
        return {"id": self.reqs[0].id, "object": self.kind, "created": self.created,
                "model": self.model_name, "choices": choices, "usage": self.usage(results)}

    # ------------------------------------------------------------ the stream
    def sse(self, choices: list[dict], **extra) -> str:
        obj = {"id": self.reqs[0].id, "object": self.kind + ".chunk" if self.chat else self.kind,
               "created": self.created, "model": self.model_name, "choices": choices, **extra}
        return f"data: {json.dumps(obj)}\n\n"

    def opening(self) -> list[str]:
        """Chat streams open with the assistant role, per choice."""
        return [self.sse([{"index": i, "delta": {"role": "assistant", "content": ""},
                           "finish_reason": None}]) for i in range(len(self.reqs))] if self.chat else []

    def tokens(self, i: int, ids: list[int], text: str, logprobs: list[float] | None) -> str | None:
        """The chunk for a committed block of choice i (None when it adds nothing to show)."""
        lp = None
        if self.logprobs[i] is not None:
            lp = self.logprobs[i].block(ids, logprobs or [])
        elif self.chat and not text:
            return None
        return self._chunk(i, text, None, lp)

    def done(self, i: int, result) -> str:
        """Choice i's last chunk: its finish reason (and vote)."""
        return self._chunk(i, "" if self.split or self.calls[i] else (None if self.chat else ""),
                           finish_reason(result), None, voting_info(result))

    def _calls(self, i: int, delta: dict, reason: str | None) -> tuple[dict, str | None]:
        """The delta with its answer text run through choice i's call stream: the text outside
        calls as content, each completed call as a `tool_calls` entry (whole arguments)."""
        shown, calls = self.calls[i].push(delta.pop("content", ""))
        if reason is not None:
            shown += self.calls[i].finish()
        if not self.tools.parallel:
            calls = calls[: max(0, 1 - self.called[i])]
        if shown:
            delta["content"] = shown
        if calls:
            delta["tool_calls"] = [tool_call_json(c, self.called[i] + k)
                                   for k, c in enumerate(calls)]
            self.called[i] += len(calls)
        if reason == "stop" and self.called[i]:
            reason = "tool_calls"
        return delta, reason

    def _chunk(self, i: int, text: str | None, reason: str | None, lp: dict | None,
               extra: dict | None = None) -> str | None:
        if not self.chat:
            choice = {"index": i, "text": text or "", "finish_reason": reason, "logprobs": lp}
            return self.sse([{**choice, **(extra or {})}])
        delta = {}
        if text is not None and self.reasoning is not None:
            thought, answer = self.reasoning[i].push(text)
            if reason is not None:
                thought += self.reasoning[i].finish()[0]
            delta = {k: v for k, v in (("reasoning_content", thought), ("content", answer)) if v}
        elif text is not None:
            delta = {"content": text}
        if self.calls[i] is not None and text is not None:
            delta, reason = self._calls(i, delta, reason)
            if not delta and reason is None and lp is None:
                return None  # all held back: a call still arriving
        choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp}
        return self.sse([{**choice, **(extra or {})}])
