"""The incremental detokenizer against full decodes, on both tokenizer formats.

For every prefix of random token streams (byte pieces, control pieces and multi-byte characters
included), fed in random chunks: the text streamed so far is always a prefix of the full decode
of the tokens fed so far (nothing streamed is ever wrong), and after `finish` the concatenated
deltas equal the full decode."""

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from mbd_jax.config import REPO_ROOT
from mbd_jax.detokenizer import IncrementalDetokenizer
from mbd_jax.tokenizer import load_tokenizer

CORPUS = ["héllo wörld, naïve café", "日本語のテキストと漢字", "emoji 🙂🚀 and ümlauts",
          "Sort: 12 7 93 and then 41", "Ελληνικά και русский текст"] * 20


@pytest.fixture(scope="module")
def byte_level_bpe(tmp_path_factory):
    """A byte-level BPE tokenizer.json (the Qwen / LLaDA2 kind), trained here."""
    hf = HFTok(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|mask|>", "<|endoftext|>"]))
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    hf.save(str(path))
    return load_tokenizer(path)


def streams(tok, rng, count: int, length: int) -> list[list[int]]:
    """Half uniformly random ids (any piece: bytes, controls, words), half real multilingual
    text's ids with random ids spliced in."""
    out = []
    for i in range(count):
        if i % 2 == 0:
            out.append(rng.integers(0, tok.vocab_size, size=length).tolist())
        else:
            ids = tok.encode(CORPUS[i % 5] + " " + CORPUS[(i + 2) % 5])[:length]
            for j in rng.integers(0, len(ids), size=3):
                ids[j] = int(rng.integers(0, tok.vocab_size))
            out.append(ids)
    return out


def check_every_prefix(tok, ids: list[int], rng) -> None:
    for n in range(len(ids) + 1):
        det, fed, emitted = IncrementalDetokenizer(tok), 0, ""
        while fed < n:
            end = min(n, fed + int(rng.integers(1, 6)))
            emitted += det.push(ids[fed: end])
            fed = end
            assert tok.decode(ids[:fed]).startswith(emitted), (ids[:fed], emitted)
        emitted += det.finish()
        assert emitted == tok.decode(ids[:n]), ids[:n]


@pytest.mark.parametrize("name", ["sentencepiece", "byte_level_bpe"])
def test_deltas_equal_the_full_decode_for_every_prefix(name, byte_level_bpe):
    tok = (load_tokenizer(REPO_ROOT / "configs/tokenizers/tiny.model") if name == "sentencepiece"
           else byte_level_bpe)
    rng = np.random.default_rng(0)
    held_back = 0
    for ids in streams(tok, rng, count=12, length=40):
        check_every_prefix(tok, ids, rng)
        det = IncrementalDetokenizer(tok)
        held_back += sum(det.push([i]) == "" for i in ids)
    assert held_back > 0  # the streams do exercise partial characters / empty pieces


def test_multibyte_characters_are_held_back_until_complete():
    tok = load_tokenizer(REPO_ROOT / "configs/tokenizers/tiny.model")
    ids = tok.encode("a 🙂")  # the emoji is four byte-fallback pieces
    assert len(ids) >= 5
    det = IncrementalDetokenizer(tok)
    out = [det.push([i]) for i in ids]
    assert out[-4:-1] == ["", "", ""] and out[-1].endswith("🙂")
    assert "".join(out) + det.finish() == "a 🙂"


def test_word_boundary_pieces_keep_their_spaces():
    """A lone sentencepiece "▁" decodes to nothing on its own (a text's leading space is dropped)
    but to a space after other text; pushed one token at a time, every space survives."""
    tok = load_tokenizer(REPO_ROOT / "configs/tokenizers/tiny.model")
    space, word, a = tok.token_to_id("▁"), tok.encode(" the")[-1], tok.encode("a")[0]
    assert tok.decode([space]) == "" and tok.decode([a, space]) == "a "
    for ids in ([a, space, word], [a, space, space, word], [a, 2, space, word], [space, word]):
        det = IncrementalDetokenizer(tok)
        streamed = [det.push([i]) for i in ids]
        assert "".join(streamed) + det.finish() == tok.decode(ids), ids
        assert streamed[-1].endswith("the") and "".join(streamed) == tok.decode(ids)


def test_cost_per_push_does_not_grow_with_the_output():
    """Each push decodes a window of recent tokens, not the whole output."""
    tok = load_tokenizer(REPO_ROOT / "configs/tokenizers/tiny.model")
    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 60)
    calls = []

    class Counting:
        def decode(self, window):
            calls.append(len(window))
            return tok.decode(window)

    det = IncrementalDetokenizer(Counting())
    text = "".join(det.push(ids[i: i + 4]) for i in range(0, len(ids), 4)) + det.finish()
    assert text == tok.decode(ids)
    assert max(calls[:-1]) <= 16 < len(ids) == calls[-1]  # windows; finish decodes once
