"""One tokenizer interface over sentencepiece models and Hugging Face `tokenizer.json` files."""

from __future__ import annotations

import abc
import pathlib

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
