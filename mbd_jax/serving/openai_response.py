"""One request's choices in the OpenAI shapes: the JSON body, and the chunks of its stream.

A request of `n` choices over several prompts runs as one scheduler Request per choice (choice
index = prompt * n + j). `Choices` turns their results, or their events as they arrive, into
`text_completion` / `chat.completion` objects: text or message (with `reasoning_content` split at
`</think>` in thinking mode), finish reasons, per-token logprobs when asked, usage over all.
"""

from __future__ import annotations

import json
import time

from mbd_jax import chat
from mbd_jax.serving.logprobs import TokenLogprobs
from mbd_jax.serving.request import Request
from mbd_jax.tokenizer import Tokenizer


def finish_reason(result) -> str:
    return {"stop": "stop", "length": "length", "max_nfe": "length"}.get(result.finish_reason, "stop")


def voting_info(result) -> dict:
    return {} if result.vote_scores is None else {
        "voting": {"answer": result.voted_answer, "final_answer": result.final_answer}}


class Choices:
    def __init__(self, reqs: list[Request], prompt_of: list[int], *, chat_format: bool,
                 thinking: bool, logprobs: bool, tokenizer: Tokenizer, model_name: str):
        self.reqs, self.prompt_of, self.chat = reqs, prompt_of, chat_format
        self.split = chat_format and thinking  # reasoning_content apart from the answer
        self.model_name = model_name
        self.created = int(time.time())
        self.kind = "chat.completion" if chat_format else "text_completion"
        self.logprobs = [TokenLogprobs(tokenizer, chat_format) if logprobs else None for _ in reqs]
        self.reasoning = [chat.ReasoningStream() for _ in reqs] if self.split else None

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
        return self._chunk(i, "" if self.split else (None if self.chat else ""),
                           finish_reason(result), None, voting_info(result))

    def _chunk(self, i: int, text: str | None, reason: str | None, lp: dict | None,
               extra: dict | None = None) -> str:
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
        choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp}
        return self.sse([{**choice, **(extra or {})}])
