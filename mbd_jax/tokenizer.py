"""One tokenizer interface over sentencepiece models and Hugging Face `tokenizer.json` files."""

from __future__ import annotations

import abc
import dataclasses
import functools
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from mbd_jax.errors import ConfigError


class Tokenizer(abc.ABC):
    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None: ...

    @property
    def drops_leading_space(self) -> bool:
        """Whether decoding drops one space at the start of a text (a sentencepiece model that
        adds a word-start mark to the first word): a reply may begin with that space."""
        return False

    @abc.abstractmethod
    def grammar_tokenizer(self, n_vocab: int, eos_ids: Sequence[int]) -> Any:
        """This vocabulary as llguidance sees it (an `LLTokenizer`: each token's bytes in the
        output text, which ones are special), for constrained decoding (grammar/compile.py).
        `n_vocab`: the model's logits width; `eos_ids`: the tokens that end an output."""


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: pathlib.Path):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"tokenizer {path}: not a readable sentencepiece model ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    def encode(self, text: str) -> list[int]:
        return list(self._sp.EncodeAsIds(text))

    def decode(self, ids: list[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.PieceToId(token)
        return None if i == self._sp.unk_id() and token != self._sp.IdToPiece(i) else i

    def grammar_tokenizer(self, n_vocab: int, eos_ids: Sequence[int]) -> Any:
        import llguidance
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2

        sp = self._sp
        user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
        special = [i for i, p in enumerate(self._proto.pieces)  # <|mask|>, <|user|>, ...
                   if sp.IsControl(i) or sp.IsUnknown(i) or sp.IsUnused(i) or p.type == user_defined]
        tokens = [bytes([int(sp.IdToPiece(i)[3:5], 16)]) if sp.IsByte(i)
                  else sp.IdToPiece(i).replace("\u2581", " ").encode()
                  for i in range(sp.GetPieceSize())]
        # llguidance tokenizes forced text in the middle of an output: no dummy prefix, spaces
        # kept as they are (a second processor of the same model with those switched off)
        proto = sentencepiece_model_pb2.ModelProto()
        proto.CopyFrom(self._proto)
        proto.normalizer_spec.add_dummy_prefix = False
        proto.normalizer_spec.remove_extra_whitespaces = False
        raw = spm.SentencePieceProcessor()
        raw.LoadFromSerializedProto(proto.SerializeToString())
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(
            tokens, special, list(eos_ids)[0],
            lambda b: raw.EncodeAsIds(b.decode("utf-8", "replace"))))
        return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=list(eos_ids))

    @property
    def drops_leading_space(self) -> bool:
        return self._proto.normalizer_spec.add_dummy_prefix

    @functools.cached_property
    def _proto(self) -> Any:
        """The model's own description (pieces and their kinds, the normalizer)."""
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._sp.serialized_model_proto())
        return proto


class HFTokenizer(Tokenizer):
    def __init__(self, path: pathlib.Path):
        from tokenizers import Tokenizer as _HF

        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise ConfigError(f"tokenizer {path}: not a readable tokenizer.json ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def grammar_tokenizer(self, n_vocab: int, eos_ids: Sequence[int]) -> Any:
        import llguidance

        # llguidance reads a tokenizer.json itself (byte-level BPE, added tokens, specials)
        return llguidance.LLTokenizer(self._tok.to_str(), n_vocab=n_vocab, eos_token=list(eos_ids))


@dataclasses.dataclass
class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer it cannot load itself."""

    tokens: list[bytes]
    special_token_ids: list[int]
    eos_token_id: int
    encode: Callable[[bytes], list[int]]
    bos_token_id: int | None = None

    def __call__(self, text: bytes) -> list[int]:
        return self.encode(text)


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
    """A `.model` file is sentencepiece; a `.json` file or a folder with tokenizer.json is HF."""
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"tokenizer: no file at {p}")
    if p.suffix == ".model":
        return SentencePieceTokenizer(p)
    if p.suffix == ".json":
        return HFTokenizer(p)
    raise ConfigError(f"tokenizer {p}: unknown format; expected a sentencepiece .model or a "
                      "tokenizer.json")
