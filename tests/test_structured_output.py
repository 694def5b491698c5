"""Structured output: every constrained output is valid by construction (checked against its
schema with jsonschema, an independent validator), unconstrained rows beside constrained ones
decode exactly as without them, the gate's device half equals NumPy, and nothing compiles after
the warm-up."""

from __future__ import annotations

import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from mbd_jax import compile_stats
from mbd_jax.checkpoint import load_model
from mbd_jax.config import DecodeConfig, Structure
from mbd_jax.decoding import gate
from mbd_jax.engine import Engine
from mbd_jax.errors import UserError
from mbd_jax.grammar.compile import Grammars
from mbd_jax.model.layers import NEG_INF

INT9 = {"type": "integer", "minimum": 0, "maximum": 9}


def _object(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


# Finite schemas of increasing difficulty: every output must end ("stop") inside the budget.
SCHEMAS = [
    {"type": "boolean"},
    {"type": "null"},
    {"const": "fixed"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    INT9,
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "string", "maxLength": 4},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "pattern": "^[a-c]{1,3}$"},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"},
    {"type": "string", "format": "date"},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 2},
    _object({"a": INT9}),
    _object({"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}}),
    _object({"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 5}},
            required=["a"]),
    _object({"p": _object({"x": INT9, "y": INT9})}),
    _object({"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                      "maxItems": 2}}),
    {"anyOf": [INT9, {"type": "boolean"}]},
    {"anyOf": [_object({"kind": {"const": "a"}, "v": {"type": "boolean"}}),
               _object({"kind": {"const": "b"}, "n": INT9})]},
    {"type": "array", "maxItems": 2, "items": _object({"id": INT9, "ok": {"type": "boolean"}})},
    {"$defs": {"pt": _object({"x": INT9, "y": INT9})}, **_object({"a": {"$ref": "#/$defs/pt"},
                                                                  "b": {"$ref": "#/$defs/pt"}})},
    {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": INT9}},
    _object({"a": _object({"b": _object({"c": _object({"d": {"type": "boolean"}})})})}),
    _object({"name": {"type": "string", "maxLength": 6}, "age": INT9,
             "role": {"enum": ["admin", "user"]}, "active": {"type": "boolean"}}),
    _object({"items": {"type": "array", "maxItems": 2, "items": _object(
        {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
         "qty": {"type": "integer", "minimum": 1, "maximum": 3}})},
        "note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]}}),
    _object({"when": {"type": "string", "format": "date"},
             "id": {"type": "string", "format": "uuid"}}),
    _object({"x": {"anyOf": [_object({"y": {"type": "array", "maxItems": 2, "items": {
        "enum": ["p", "q"]}}}), {"type": "boolean"}]}}),
    # what pydantic emits for a model with a Literal, a bounded int and a nested model
    {"$defs": {"Point": {"additionalProperties": False, "properties": {
        "x": {"maximum": 9, "minimum": 0, "title": "X", "type": "integer"},
        "y": {"maximum": 9, "minimum": 0, "title": "Y", "type": "integer"}},
        "required": ["x", "y"], "title": "Point", "type": "object"}},
     "additionalProperties": False, "properties": {
        "kind": {"enum": ["a", "b"], "title": "Kind", "type": "string"},
        "at": {"$ref": "#/$defs/Point"},
        "tags": {"items": {"maxLength": 3, "type": "string"}, "maxItems": 2, "title": "Tags",
                 "type": "array"}},
     "required": ["kind", "at", "tags"], "title": "Shape", "type": "object"},
]


@pytest.fixture(scope="module")
def random_model():
    return load_model("tiny-test")


@pytest.fixture(scope="module")
def engine(random_model):
    m = random_model
    eng = Engine(m.cfg, m.params, batch_size=8, buffer_size=3, prefill_chunk=64,
                 tokenizer=m.tokenizer, debug=True)  # debug: the gate's invariants every step
    eng.warmup(buckets=[8, 16])
    return eng


def _prompts(tokenizer, n):
    return [tokenizer.encode(f"Reply with JSON number {i}:") for i in range(n)]


def _check_valid(results, schemas):
    for r, schema in zip(results, schemas):
        assert r.finish_reason == "stop", (schema, r.text)
        jsonschema.validate(json.loads(r.text), schema)


@pytest.mark.parametrize("buffer_size,temperature,mode", [
    (1, 0.0, "naive"), (3, 0.0, "naive"), (3, 1.0, "naive"), (2, 0.0, "edit")])
def test_every_output_is_valid_json_for_its_schema(engine, random_model, buffer_size,
                                                   temperature, mode):
    """Random weights: only the constraint makes the text valid. N_buf 1 and 3 (eager), greedy
    and sampled with a seed, edit mode; each row has its own schema."""
    decodes = [DecodeConfig(max_new_tokens=200, buffer_size=buffer_size, temperature=temperature,
                            seed=i, block_activation="eager" if buffer_size > 1 else "progress",
                            sampling_mode=mode, edit_threshold=0.3,
                            structure=Structure.json_schema(s)) for i, s in enumerate(SCHEMAS)]
    results = engine.generate(_prompts(random_model.tokenizer, len(SCHEMAS)), decodes)
    _check_valid(results, SCHEMAS)


def test_unconstrained_rows_beside_constrained_ones_are_untouched(engine, random_model):
    """A mixed batch: the unconstrained rows' tokens equal their run without the constrained
    rows, bit for bit; the constrained ones are valid. Sampling with seeds, edit mode too."""
    prompts = _prompts(random_model.tokenizer, 8)
    plain = [DecodeConfig(max_new_tokens=40, buffer_size=3, temperature=t, seed=i,
                          sampling_mode=mode)
             for i, (t, mode) in enumerate([(0.0, "naive"), (1.0, "naive"), (0.0, "edit"),
                                            (0.7, "naive")])]
    alone = engine.generate(prompts[:4], plain)
    schemas = SCHEMAS[-4:]
    constrained = [DecodeConfig(max_new_tokens=200, buffer_size=2, seed=7, temperature=0.5,
                                structure=Structure.json_schema(s)) for s in schemas]
    mixed = engine.generate(prompts, plain + constrained)
    for a, m in zip(alone, mixed[:4]):
        assert a.token_ids == m.token_ids
    _check_valid(mixed[4:], schemas)


def test_regex_choice_grammar_and_json_object(engine, random_model):
    tok = random_model.tokenizer
    cases = [
        (Structure("regex", "[0-9]{3}-[a-z]{2,4}"), r"[0-9]{3}-[a-z]{2,4}"),
        (Structure("choice", json.dumps(["alpha", "beta", "gamma delta"])),
         "alpha|beta|gamma delta"),
        (Structure("grammar", 'start: "(" item ("," item)~0..2 ")"\nitem: /[xy]/'),
         r"\([xy](,[xy]){0,2}\)"),
        (Structure("grammar", 'root ::= "<" [a-c]{1,4} ">"'), "<[a-c]{1,4}>"),
    ]
    import re
    results = engine.generate(_prompts(tok, len(cases)),
                              [DecodeConfig(max_new_tokens=64, structure=s) for s, _ in cases])
    for r, (_, pattern) in zip(results, cases):
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), (pattern, r.text)
    # json_object: any JSON object; with a small budget it may run out: then a prefix, "length"
    r = engine.generate(_prompts(tok, 1), DecodeConfig(max_new_tokens=24,
                                                       structure=Structure("json_object")))[0]
    assert r.text.lstrip().startswith("{")  # (one space may come first: json_schema.py)
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    else:
        assert r.finish_reason == "length" and len(r.token_ids) == 24


def test_a_grammar_that_cannot_finish_in_the_budget_ends_with_length(engine, random_model):
    """The text is the valid prefix that fits: never invalid text, never a forced end."""
    s = Structure("regex", "a{40}")
    r = engine.generate(_prompts(random_model.tokenizer, 1),
                        DecodeConfig(max_new_tokens=10, structure=s))[0]
    assert r.finish_reason == "length" and r.text == "a" * len(r.text) and len(r.token_ids) == 10


def test_constrained_rows_with_the_prefix_cache(random_model):
    """A prefix store under constrained rows: the second run of the same prompts maps their
    stored blocks and decodes the same valid text (committed blocks are accepted text)."""
    from mbd_jax.cache.prefix_store import PrefixStore
    m = random_model
    store = PrefixStore("structured", m.cfg.block_size, ram_bytes=1 << 24)
    eng = Engine(m.cfg, m.params, batch_size=4, buffer_size=2, prefill_chunk=64,
                 tokenizer=m.tokenizer, prefix_store=store)
    prompts = [m.tokenizer.encode("A long shared system line for the prefix cache. " * 3 + q)
               for q in ("One", "Two")]
    decodes = [DecodeConfig(max_new_tokens=200, buffer_size=2, structure=Structure.json_schema(s))
               for s in SCHEMAS[-2:]]
    first = eng.generate(prompts, decodes)
    eng.flush()
    again = eng.generate(prompts, decodes)
    assert eng.stats().prefix_hit_tokens > 0
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    _check_valid(again, SCHEMAS[-2:])


def test_nothing_compiles_after_warmup_with_constrained_rows(engine, random_model):
    before = compile_stats.compiles()
    engine.generate(_prompts(random_model.tokenizer, 3),
                    [DecodeConfig(max_new_tokens=32, structure=Structure.json_schema(SCHEMAS[16])),
                     DecodeConfig(max_new_tokens=32),
                     DecodeConfig(max_new_tokens=32, buffer_size=2,
                                  structure=Structure("regex", "[0-9]+"))])
    assert compile_stats.compiles() == before


@pytest.mark.parametrize("structure,message", [
    (Structure("json_schema", '{"type": "strin"}'), "strin"),
    (Structure("json_schema", '{"type": "object", "if": {}, "then": {}}'), "Unimplemented keys"),
    (Structure("json_schema", '{"type": "string", "format": "weird"}'), "Unknown format"),
    (Structure("json_schema", '{"$ref": "#/$defs/missing"}'), "does not exist"),
    (Structure("json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}'), "minimum"),
    (Structure("regex", "a[b"), "regex"),
    (Structure("regex", "[a&&b]"), "matches no text"),
    (Structure("grammar", "start: undefined_rule"), "undefined_rule"),
])
def test_a_bad_grammar_is_a_clear_error(engine, structure, message):
    with pytest.raises(UserError, match="decoding.structure.source") as e:
        engine.check_decode(DecodeConfig(structure=structure))
    assert message in str(e.value)


@pytest.mark.parametrize("fields,message", [
    ({"kind": "json_schema", "source": "{"}, "not valid JSON"),
    ({"kind": "json_schema", "source": "[1]"}, "must be a JSON Schema"),
    ({"kind": "json_schema", "source": "[" * 30 + "]" * 30}, "nests deeper"),
    ({"kind": "regex", "source": "a" * 40_000}, "the limit is"),
    ({"kind": "choice", "source": "[]"}, "list of 1 to"),
    ({"kind": "json_object", "source": "{}"}, "must be empty"),
    ({"kind": "xml", "source": "x"}, "must be one of"),
])
def test_malformed_structures_are_refused_by_field(fields, message):
    from mbd_jax.config import from_dict
    from mbd_jax.errors import ConfigError
    with pytest.raises(ConfigError, match=message) as e:
        from_dict(DecodeConfig, {"structure": fields}, where="decoding")
    assert "decoding.structure" in str(e.value)


def test_structure_with_voting_or_ignore_eos_is_refused():
    from mbd_jax.config import VotingConfig
    from mbd_jax.errors import ConfigError
    s = Structure("regex", "a+")
    for bad in (dict(voting=VotingConfig()), dict(ignore_eos=True)):
        with pytest.raises(ConfigError, match="structured output cannot be combined"):
            DecodeConfig(structure=s, **bad).validate()


def test_gate_mask_equals_numpy_and_leaves_other_rows_bit_for_bit():
    rng = np.random.default_rng(0)
    b, w, v = 3, 8, 70
    logits = rng.standard_normal((b, w, v)).astype(np.float32)
    allowed_bits = rng.random((b, v)) < 0.3
    words = gate.mask_words(v)
    allowed = np.zeros((b, words), np.uint32)
    for r in range(b):
        for t in np.flatnonzero(allowed_bits[r]):
            allowed[r, t // 32] |= np.uint32(1 << (t % 32))
    offset = np.array([2, 9, -1], np.int32)  # row 0: gate at 2; rows 1, 2: outside the window
    out = np.asarray(gate.mask_logits(jnp.asarray(logits), jnp.asarray(offset),
                                      jnp.asarray(allowed)))
    np.testing.assert_array_equal(out[1:], logits[1:])
    np.testing.assert_array_equal(out[0, np.arange(w) != 2], logits[0, np.arange(w) != 2])
    np.testing.assert_array_equal(out[0, 2][allowed_bits[0]], logits[0, 2][allowed_bits[0]])
    assert (out[0, 2][~allowed_bits[0]] == NEG_INF).all()
    assert np.array_equal(np.asarray(gate.token_bits(jnp.asarray(allowed), v)), allowed_bits)


def test_row_grammar_consumes_the_run_clears_the_first_rejected_token_and_ends_at_eos(
        random_model):
    """The host half on hand-made windows: tokens of '{"a": 1}' arriving out of order."""
    m = random_model
    tok, mask = m.tokenizer, m.cfg.mask_token_id
    grammars = Grammars(tok, m.cfg.vocab_size, m.cfg.eos_token_ids, mask)
    schema = Structure.json_schema(_object({"a": INT9}))
    ids = tok.encode('{"a": 1}')[1:]  # (sentencepiece's leading "▁" piece left out)
    start = 5  # the prompt's length: the gate starts there
    row = grammars.row(schema, start)

    def allowed(token):
        return bool(row.mask[token // 32] >> np.uint32(token % 32) & 1)

    assert row.gate == start and allowed(ids[0]) and not allowed(ids[1])
    window = np.full(16, mask, np.int32)
    window[2:4] = ids[2:4]  # filled ahead of the gate: provisional, nothing to consume
    assert not row.advance(window, start) and row.gate == start
    window[0:2] = ids[0:2]
    assert not row.advance(window, start) and row.gate == start + 4  # the run up to the MASK
    window[4] = tok.encode("}")[-1]  # a '}' before the value: rejected, to be cleared
    assert row.advance(window, start) and row.gate == start + 4
    window[4:len(ids)] = ids[4:]
    window[len(ids)] = m.cfg.eos_token_ids[0]
    assert not row.advance(window, start)
    assert row.gate == start + len(ids) + 1  # past the EOS: the grammar may end there


def test_object_schemas_that_do_not_say_take_no_other_properties():
    """closed_objects: every object schema without additionalProperties gets false (nested in
    properties, items, anyOf, $defs), one that says keeps its word, and a property named like a
    keyword is a name, not a keyword."""
    from mbd_jax.grammar.json_schema import closed_objects
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": {"properties": {"y": {}}}},
        "either": {"anyOf": [{"properties": {"z": {}}}, {"type": "null"}]}},
        "$defs": {"D": {"properties": {"w": {}}}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["properties"]["properties"]  # a name map
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert schema["properties"]["list"]["items"] == {"properties": {"y": {}}}  # not mutated


def _finite_schemas(depth: int = 0):
    """Hypothesis strategy: JSON Schemas whose every valid value is short (bounded strings,
    numbers, arrays, closed objects), nested up to 3 levels."""
    from hypothesis import strategies as st
    names = st.text("abcdefgh", min_size=1, max_size=4)
    leaves = st.one_of(
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.lists(names, min_size=1, max_size=3, unique=True).map(lambda xs: {"enum": xs}),
        st.tuples(st.integers(-20, 20), st.integers(0, 30)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "string", "pattern": "^[a-z]{1,3}$"}))
    if depth >= 3:
        return leaves
    inner = st.deferred(lambda: _finite_schemas(depth + 1))
    arrays = st.tuples(inner, st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})
    objects = st.dictionaries(names, inner, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(lambda req: {
            "type": "object", "properties": props, "required": sorted(req)}))
    either = st.lists(inner, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs})
    return st.one_of(leaves, arrays, objects, either)


def test_generated_schemas_give_valid_output(engine, random_model):
    """Hypothesis draws schemas (nested objects, arrays, enums, bounded numbers and strings,
    anyOf): every constrained output on random weights validates."""
    from hypothesis import HealthCheck, given, settings

    prompt = _prompts(random_model.tokenizer, 1)

    @settings(max_examples=15, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(schema=_finite_schemas())
    def check(schema):
        (r,) = engine.generate(prompt, DecodeConfig(max_new_tokens=600, buffer_size=2,
                                                    structure=Structure.json_schema(schema)))
        assert r.finish_reason == "stop", (schema, r.text)
        jsonschema.validate(json.loads(r.text), schema)

    check()


def test_a_byte_level_bpe_tokenizer_json_as_converted_models_ship(tmp_path, random_model):
    """The Hugging Face path (llguidance reads the tokenizer.json itself): a byte-level BPE
    trained here with the special tokens at the model's ids; constrained outputs of the random
    model through it are valid JSON."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from mbd_jax.tokenizer import load_tokenizer
    m = random_model
    specials = ["<pad>", "<unk>", "</s>", "<s>", "<|mask|>"]  # ids 0-4: pad, eos 2, mask 4
    hf = HFTok(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ['{"name": "ab", "n": [1, 2, 3]}', "Reply with JSON please", "true false null"] * 50
    hf.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert [tok.token_to_id(s) for s in specials] == [0, 1, 2, 3, 4]
    assert not tok.drops_leading_space and tok.vocab_size <= m.cfg.vocab_size
    eng = Engine(m.cfg, m.params, batch_size=4, buffer_size=2, prefill_chunk=64, tokenizer=tok)
    schemas = SCHEMAS[-4:]
    results = eng.generate([tok.encode(f"Reply with JSON {i}") for i in range(len(schemas))],
                           [DecodeConfig(max_new_tokens=300, buffer_size=2,
                                         structure=Structure.json_schema(s)) for s in schemas])
    _check_valid(results, schemas)


def test_a_function_named_like_a_tool_choice_mode_is_still_that_function():
    """tool_choice naming a function called "auto" forces a call of it (not the auto mode),
    and the call grammar offers that function only."""
    from types import SimpleNamespace

    from mbd_jax import tool_calls
    from mbd_jax.serving import tool_use
    functions = tool_calls.check_tools([{"type": "function", "function": {"name": n}}
                                        for n in ("auto", "other")])
    req = SimpleNamespace(tools=functions, parallel_tool_calls=None,
                          tool_choice=tool_use.check_tool_choice(
                              {"type": "function", "function": {"name": "auto"}}))
    use = tool_use.read(req)
    assert use.forced and use.name == "auto"
    source = use.structure().source
    assert '{"const": "auto"}' in source and '"other"' not in source
    assert not tool_use.read(SimpleNamespace(tools=functions, parallel_tool_calls=None,
                                             tool_choice="auto")).forced
