"""Structures (config/structure.py) compiled into llguidance matchers for one model's tokenizer.

llguidance (a Rust library: lazy lexer, Earley parser, token masks in tens of microseconds)
checks a run of tokens from any state (`validate_tokens`) and gives the token mask of a state:
the two things block diffusion needs (docs/architecture.md, "Structured output"). A compiled
grammar is kept per structure (least recently used out); each request gets a copy of its
matcher."""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from typing import Any

from mbd_jax.config.structure import Structure
from mbd_jax.decoding.gate import mask_words
from mbd_jax.errors import UserError
from mbd_jax.grammar.row import RowGrammar
from mbd_jax.grammar.json_schema import json_lark
from mbd_jax.tokenizer import Tokenizer

COMPILED_KEPT = 64  # distinct structures kept compiled per engine


def grammar_text(structure: Structure) -> str:
    """The llguidance grammar of a structure (not yet checked; ValueError when its source cannot
    be read at all)."""
    import llguidance

    if structure.kind in ("json_schema", "json_object"):  # (read as grammar/json_schema.py says)
        schema = json.loads(structure.source) if structure.kind == "json_schema" else {
            "type": "object"}
        return llguidance.LLMatcher.grammar_from_lark(json_lark(schema))
    if structure.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structure.source)
    if structure.kind == "choice":
        return llguidance.grammar_from("choice", structure.source)
    # a Lark grammar, or GBNF (llama.cpp's), which llguidance converts (ValueError if it cannot)
    return llguidance.grammar_from("gbnf" if "::=" in structure.source else "lark",
                                   structure.source)


def with_leading_space(text: str) -> str:
    """llguidance grammar `text` with one optional space before its words. A sentencepiece
    tokenizer that adds a word-start mark to a text's first word writes a reply's first piece
    with it ("▁{", "▁2") and drops it again when it decodes, so the text is the grammar's word
    either way; without the space the model's first token would be forced elsewhere and every
    token after it would sit one place off."""
    inner = (json.loads(text)["grammars"] if text.lstrip().startswith("{")
             else [{"lark_grammar": text}])  # llguidance's JSON form, or a Lark grammar
    inner[0] = {**inner[0], "name": "words"}
    return json.dumps({"grammars": [{"name": "start", "lark_grammar": 'start: " "? @words'},
                                    *inner]})


class Grammars:
    """The compiled structures of one engine (its tokenizer and vocabulary)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: Sequence[int],
                 mask_token_id: int):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, list(eos_ids)
        self._mask_id = mask_token_id
        self._llg_tokenizer: Any = None  # built on the first structure (about 1 s for 150K tokens)
        self._compiled: collections.OrderedDict[Structure, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # the service checks on its event loop, admits on its engine thread

    @property
    def words(self) -> int:
        """uint32 words of a token mask (one bit per token of the vocabulary)."""
        return mask_words(self._vocab_size)

    def check(self, structure: Structure, where: str = "decoding.structure.source") -> None:
        """Compiles `structure` (kept for the request's admission); UserError naming `where` (the
        field that holds its source) and the grammar's problem if it cannot be compiled or uses
        what is not supported."""
        self._matcher(structure, where)

    def row(self, structure: Structure | None, prompt_len: int) -> RowGrammar | None:
        """A request's grammar state at its start (None without a structure): a copy of the
        structure's compiled matcher, its gate at the first generated position."""
        if structure is None:
            return None
        matcher = self._matcher(structure, "decoding.structure.source").deep_copy()
        return RowGrammar(matcher, prompt_len, self.words, self._mask_id, self._eos)

    def _matcher(self, structure: Structure, where: str) -> Any:
        with self._lock:
            if structure in self._compiled:
                self._compiled.move_to_end(structure)
                return self._compiled[structure]
            if self._tokenizer is None:
                raise UserError(f"{where}: structured output needs the model's tokenizer "
                                "(this engine has none)")
            if self._llg_tokenizer is None:
                self._llg_tokenizer = self._tokenizer.grammar_tokenizer(self._vocab_size, self._eos)
        try:
            text = grammar_text(structure)
        except ValueError as e:
            raise UserError(f"{where}: {_short(e)}") from None
        matcher = self._compile(text, where)
        probe = matcher.deep_copy()  # (a grammar with no way on errs while computing its mask)
        probe.compute_bitmask()
        if probe.is_error():
            raise UserError(f"{where}: matches no text (no token can start it)")
        if self._tokenizer.drops_leading_space:
            matcher = self._compile(with_leading_space(text), where)
        with self._lock:
            self._compiled[structure] = matcher
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return matcher

    def _compile(self, text: str, where: str) -> Any:
        """A matcher of llguidance grammar `text`; UserError naming `where` if it is refused."""
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self._llg_tokenizer)
        if failed or messages:  # a warning is a keyword or format it would ignore: refused too
            raise UserError(f"{where}: {_short(messages[0])}")
        matcher = llguidance.LLMatcher(self._llg_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise UserError(f"{where}: {_short(matcher.get_error())}")
        return matcher


def _short(message: Any) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= 300 else text[:300] + "..."
