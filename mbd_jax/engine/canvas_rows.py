"""The one record a canvas engine keeps per busy row (`CanvasRow`): where its generation is
(canvas index, cached positions, the canvas waiting to be committed), what it has output and
counted, and the rule that turns a finished canvas into output (`canvas_output`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mbd_jax.config.diffusion_gemma import DiffusionGemmaConfig
from mbd_jax.engine.results import GenerationResult
from mbd_jax.engine.rows import EngineRequest, RowEvent


def canvas_output(canvas: list[int], room: int, eos_ids) -> tuple[list[int], bool, bool]:
    """(the tokens a finished canvas adds: up to its first EOS, at most `room`; whether the
    output ended with that EOS; whether the canvas holds an EOS at all: the row ends)."""
    eos = next((j for j, t in enumerate(canvas) if t in eos_ids), None)
    if eos is None:
        return canvas[:room], False, False
    return canvas[: min(eos, room)], eos < room, True


@dataclasses.dataclass(eq=False)
class CanvasRow:
    request: EngineRequest
    pages: list[int]  # KV pool pages held, in order
    canvases: int  # canvases its token budget allows
    prefilled: int = 0  # prompt positions [0, prefilled) are in its pages
    page_keys: list[bytes] = dataclasses.field(default_factory=list)  # its prompt pages'
    # prefix keys (pages.py), indexed once its prompt is in
    index: int = 0  # the current canvas's index in its generation
    fresh: bool = True  # the current canvas has not started (the next decode call starts it)
    commit: np.ndarray | None = None  # [C] the previous canvas, committed by the next call
    tokens: list[int] = dataclasses.field(default_factory=list)  # output so far
    eos: bool = False  # the output ended with an EOS (not in tokens)
    passes: int = 0  # decoder passes over its finished canvases
    commits_apart: int = 0  # commits that took a forward of their own (buffer_size 1)
    ending: str | None = None  # "cancel" or "stop" (engine.end)

    def cached_len(self, canvas_length: int) -> int:
        """Positions in its cache, where its current canvas starts: the prompt and the
        canvases before it."""
        return len(self.request.prompt) + self.index * canvas_length

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)

    def canvas_done(self, argmax: np.ndarray, steps: int, cfg: DiffusionGemmaConfig) -> RowEvent:
        """Takes a finished canvas (argmax [C], after `steps` passes): its output tokens, then
        either the row finishes (an EOS in it, or its budget spent) or the canvas waits to be
        committed and the next one starts at the next call."""
        room = self.request.decode.max_new_tokens - len(self.tokens)
        new, self.eos, has_eos = canvas_output(argmax.tolist(), room, cfg.eos_token_ids)
        self.tokens += new
        self.passes += steps
        finished = has_eos or self.index + 1 >= self.canvases
        if not finished:
            self.commit, self.fresh = argmax, True
            self.index += 1
        return RowEvent(self.request, new, None, finished=finished)

    def result(self, tokenizer, reason: str | None, seconds: float) -> GenerationResult:
        """The finished row's result; `reason` None: "stop" after an EOS, else "length"."""
        r = GenerationResult(
            token_ids=list(self.tokens), finish_reason=reason or ("stop" if self.eos else "length"),
            nfe=self.passes, tokens_unmasked=0, bubble_forwards=self.commits_apart, edits=0,
            blocks=self.index + 1, max_active_blocks=self.request.decode.buffer_size,
            prompt_tokens=len(self.request.prompt), seconds=seconds, eos=self.eos)
        if tokenizer is not None:
            r.text = tokenizer.decode(r.token_ids)
        return r
