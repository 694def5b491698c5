"""Both tokenizer formats behind one interface."""

from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers

from mbd_jax.config import REPO_ROOT
from mbd_jax.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer


def test_sentencepiece_round_trip_and_special_ids(cfg):
    tok = load_tokenizer(REPO_ROOT / "configs/tokenizers/tiny.model")
    assert isinstance(tok, SentencePieceTokenizer)
    text = "<|user|> What is 12 + 30? <|assistant|> 42"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.token_to_id("<|mask|>") == cfg.mask_token_id
    assert tok.token_to_id("</s>") == cfg.eos_token_ids[0]
    assert tok.vocab_size == cfg.vocab_size


def test_hf_tokenizer_json_round_trip(tmp_path):
    vocab = {"[UNK]": 0, "<|mask|>": 1, "hello": 2, "world": 3}
    hf = HFTok(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)  # a folder holding tokenizer.json
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world hello") == [2, 3, 2]
    assert tok.decode([2, 3]) == "hello world"
    assert tok.token_to_id("<|mask|>") == 1 and tok.vocab_size == 4
