"""A LLaDA2.2-shaped checkpoint (LLaDA2's tensor layout in safetensors, a byte-level BPE
tokenizer.json with the edit actions as special tokens, 2.2's config fields) converts with its
block routing, editing ids, long-context length and decoding defaults, and serves: the service's
answers equal offline generation under Levenshtein editing."""

from __future__ import annotations

import json

import httpx
import pytest

from mbd_jax.checkpoint import load_model
from mbd_jax.config import DecodeConfig, model_generation_settings
from mbd_jax.convert import convert
from mbd_jax.engine import Engine
from mbd_jax.errors import UserError
from tests.conftest import ROOT  # noqa: F401  (the repository root on sys.path)
from tests.test_convert import LLADA, llada_state_dict, write_llada

SPECIALS = ["<pad>", "<|mask|>", "<|endoftext|>", "<|delete|>", "<|split|>"]  # ids 0..4
LLADA22 = {**LLADA, "vocab_size": 320, "mask_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
           "delete_token_id": 3, "split_token_id": 4, "block_size": 4, "expert_capacity": 4,
           "max_position_embeddings": 512,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 128}}
GENERATION = {"eos_token_id": 2, "threshold": 0.7, "editing_threshold": 0.5, "max_post_steps": 4}


def write_tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ["Sort the numbers 3 1 2 and say why", "What is 12 + 30?", "def add(a, b):"] * 40
    hf.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=LLADA22["vocab_size"], special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llada22")
    src = write_llada(tmp / "hf", llada_state_dict(seed=5, c=LLADA22), LLADA22)
    write_tokenizer(src)
    (src / "generation_config.json").write_text(json.dumps(GENERATION))
    manifest = convert(src, tmp / "out", dtype="float32", progress=False)
    return tmp / "out", manifest


def test_the_llada22_fields_convert(converted):
    out, manifest = converted
    m = load_model(str(out))  # checks the manifest's checksums
    cfg = m.cfg
    assert manifest["family"] == "llada2_moe"
    assert (cfg.router_block_pool, cfg.router_block_window, cfg.block_size) == (4, 0, 4)
    assert (cfg.delete_token_id, cfg.split_token_id, cfg.mask_token_id) == (3, 4, 1)
    assert cfg.max_seq_len == 512 and cfg.rope_scaling.type == "yarn"
    assert [m.tokenizer.token_to_id(t) for t in SPECIALS[3:]] == [3, 4]
    assert model_generation_settings(str(out / "config.yaml"))["decoding"] == {
        "accept_threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 4,
        "sampling_mode": "indel"}


def test_half_an_edit_pair_or_a_pool_out_of_range_is_refused(tmp_path):
    bad = {**LLADA22}
    del bad["split_token_id"]
    src = write_llada(tmp_path / "a", llada_state_dict(c=LLADA22), bad)
    with pytest.raises(UserError, match="delete_token_id but not split_token_id"):
        convert(src, tmp_path / "out", dtype="float32", progress=False)
    src = write_llada(tmp_path / "b", llada_state_dict(c=LLADA22), {**LLADA22, "expert_capacity": 1})
    with pytest.raises(UserError, match="expert_capacity 1 must be in"):
        convert(src, tmp_path / "out", dtype="float32", progress=False)


def test_the_service_serves_it_with_levenshtein_editing(tmp_path, converted):
    """`mbd-jax serve` on the converted directory: completions under indel (the checkpoint's
    default) and naive mode equal offline generation; a bad sampling mode is a 400 naming it."""
    from tests.live_server import KEY, Server

    out, _ = converted
    m = load_model(str(out))
    engine = Engine(m.cfg, m.params, batch_size=2, buffer_size=2, prefill_chunk=16,
                    tokenizer=m.tokenizer)
    prompts = ["Sort the numbers 3 1 2", "What is 12 + 30?"]
    srv = Server(tmp_path, [KEY], sections={"model": str(out), "decoding": {}},
                 max_batch_size=2, prefill_chunk=16)
    try:
        with httpx.Client(base_url=srv.url, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as http:
            for mode in ("indel", "naive"):
                decode = DecodeConfig(max_new_tokens=16, buffer_size=2, accept_threshold=0.7,
                                      edit_threshold=0.5, max_post_edit_steps=4,
                                      sampling_mode=mode)
                want = engine.generate([m.tokenizer.encode(p) for p in prompts], decode)
                assert all(len(w.token_ids) >= 4 for w in want)
                for p, w in zip(prompts, want):
                    body = {"prompt": p, "max_tokens": 16,
                            "decoding": {"buffer_size": 2, "sampling_mode": mode}}
                    r = http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == w.text
            r = http.post("/v1/completions", json={"prompt": "x", "decoding": {
                "sampling_mode": "levenshtein"}})
            assert r.status_code == 400 and "sampling_mode" in r.text, r.text
    finally:
        srv.stop()
