"""Structured outputs (issue 38): ``response_format`` enforced by constrained decoding
(``executor.grammar``, llguidance).

The grammar's mask and the sampler on SmolLM2's real vocabulary (greedy, seeded sampling and
speculative verification all pick only grammatical tokens); the request shapes and the 400s of
schemas that cannot be enforced; and a random-weight synthetic model served over HTTP, whose free
text is gibberish, answering a nested schema 100 times of 100 through the official ``openai``
client's ``parse`` at concurrency 8, streamed and not.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field
from strata.executor.grammar import (
    Constraint,
    GrammarError,
    json_schema_grammar,
    next_masks,
    vocabulary,
)
from strata.executor.sampling import Sampler, SamplingParams
from strata.executor.server.protocol import APIError, ChatCompletionRequest, CompletionRequest


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict mode has
    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=100_000_000)
    kind: Literal["village", "town", "city"]
    score: float = Field(ge=0, le=10)


class Answer(BaseModel):
    """The nested schema of the acceptance test: objects, an array, enums, numbers, a boolean,
    all fields required, no other keys (the ``openai`` client's strict form of it)."""

    model_config = ConfigDict(extra="forbid")
    country: str = Field(max_length=24)
    cities: list[City] = Field(min_length=1, max_length=3)
    capital: bool


ANSWER_SCHEMA = Answer.model_json_schema()


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    from strata.executor.tokenizer import GGUFTokenizer

    return vocabulary(GGUFTokenizer.from_gguf(smollm2_gguf))


def _decode_with(sampler: Sampler, vocab, steps: int, seed: int) -> list[int]:
    """Tokens picked from random logits under ``sampler``'s grammar until an end-of-generation
    token (or ``steps``)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(steps):
        t = sampler(rng.normal(0, 3, vocab.size).astype(np.float32))
        sampler.observe([t])
        if t in vocab.tokenizer.eog_ids:
            break
        out.append(t)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_pick_fits_the_schema(vocab, temperature):
    """Random logits, greedy or sampled: the text is valid JSON of the schema and ends in an
    end-of-generation token."""
    grammar = json_schema_grammar(ANSWER_SCHEMA)
    for seed in range(5):
        params = SamplingParams(temperature=temperature, seed=seed)
        sampler = Sampler(params, Constraint(vocab, grammar))
        ids = _decode_with(sampler, vocab, 400, seed)
        assert len(ids) < 400, "never ended"
        Answer.model_validate_json(vocab.tokenizer.decode(ids))


def test_without_a_grammar_the_same_logits_give_other_text(vocab):
    """The test above can fail: unconstrained, the same random logits are not JSON."""
    ids = _decode_with(Sampler(SamplingParams()), vocab, 50, 0)
    with pytest.raises(ValueError):
        Answer.model_validate_json(vocab.tokenizer.decode(ids))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verified_drafts_fit_the_schema(vocab, temperature):
    """Speculative verification under a grammar: a draft token the grammar refuses is never
    accepted, the rows after an accepted draft token are masked for the state after it, and the
    grammar's state is where the accepted tokens left it."""
    grammar = json_schema_grammar(ANSWER_SCHEMA)
    rng = np.random.default_rng(7)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=3), Constraint(vocab, grammar))
    ids: list[int] = []
    for _ in range(200):
        # A draft of what the grammar allows, then a token it refuses.
        probe = Constraint(vocab, grammar)
        probe.consume(ids)
        draft = []
        for _ in range(3):
            allowed = np.flatnonzero(probe.mask())
            if not len(allowed) or probe._m.is_stopped():
                break
            draft.append(int(rng.choice(allowed)))
            probe.consume(draft[-1:])
        refused = np.flatnonzero(~probe.mask())
        draft.append(int(refused[0]))
        logits = rng.normal(0, 3, (len(draft) + 1, vocab.size)).astype(np.float32)
        for j, t in enumerate(draft):  # make every draft token the row's favourite
            logits[j, t] = 50.0
        toks = sampler.verify(logits, draft)
        accepted = toks[:-1]  # a prefix of the draft, never its refused last token
        assert accepted == draft[: len(accepted)] and len(accepted) < len(draft)
        sampler.observe(toks)
        ends = [i for i, t in enumerate(toks) if t in vocab.tokenizer.eog_ids]
        ids += toks[: ends[0]] if ends else toks
        if ends:
            break
    Answer.model_validate_json(vocab.tokenizer.decode(ids))


def test_masks_along_a_draft_leave_the_state_as_it_was(vocab):
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    c = Constraint(vocab, grammar)
    before = c.mask()
    tok = vocab.tokenizer
    draft = tok.encode('{"a": 12', add_bos=False)
    masks = c.masks_along(draft)
    assert len(masks) == len(draft) + 1
    assert all(m[t] for m, t in zip(masks, draft, strict=False))
    assert np.array_equal(c.mask(), before)
    assert not masks[-1][tok.encode("x", add_bos=False)[0]]  # a letter cannot follow 12


@pytest.mark.parametrize(
    ("response_format", "words"),
    [
        ({"type": "xml"}, "'xml' is not one of text, json_object, json_schema"),
        ({}, "response_format.type is missing"),
        (
            {"type": "json_schema", "schema": {"type": "string", "pattern": "(?=a)b"}},
            "regex parse error: look-around",
        ),
        ("json", "must be an object"),
        ({"type": "json_schema"}, "json_schema is missing"),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "json_schema.schema is missing"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}, "json_schema.x"),
        ({"type": "json_object", "strict": True}, "response_format.strict"),
        ({"type": "json_schema", "schema": {"type": "strng"}}, "Invalid type: strng"),
        (
            {"type": "json_schema", "schema": {"type": "string", "format": "ipv9"}},
            "Unknown format: ipv9",
        ),
        (
            {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}},
            "uniqueItems",
        ),
        ({"type": "json_schema", "json_schema": {"schema": []}}, "must be a JSON object"),
        ({"type": "json_schema", "json_schema": {"schema": False}}, "allows no value"),
        # review: a non-object x-guidance was a 500 (TypeError merging it into the options)
        ({"type": "json_schema", "schema": {"type": "object", "x-guidance": "a"}}, "x-guidance"),
        ({"type": "json_schema", "schema": {"type": "object", "x-guidance": [1]}}, "x-guidance"),
        # review: mistyped json_schema keys were accepted
        ({"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}, "json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"strict": "yes", "schema": {}}},
            "json_schema.strict must be true or false",
        ),
    ],
)
def test_a_schema_that_cannot_be_enforced_is_a_400_naming_it(response_format, words):
    for cls, extra in (
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
        (CompletionRequest, {"prompt": "x"}),
    ):
        body = cls.model_validate({**extra, "response_format": response_format})
        with pytest.raises(APIError) as e:
            body.response_grammar()
        assert e.value.status == 400 and e.value.param == "response_format"
        assert words in e.value.message, e.value.message


def test_the_shapes_clients_send():
    messages = [{"role": "user", "content": "x"}]

    def grammar(rf):
        return ChatCompletionRequest.model_validate(
            {"messages": messages, "response_format": rf}
        ).response_grammar()

    assert grammar(None) is None and grammar({"type": "text"}) is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    nested = grammar({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert nested == grammar({"type": "json_schema", "schema": schema})  # the top-level shape
    assert nested == grammar({"type": "json_object", "schema": schema})  # llama-server's
    assert json.loads(grammar({"type": "json_object"}))["grammars"][0]["json_schema"]["type"] == (
        "object"
    )


def test_ignore_eos_with_a_grammar_is_refused(smollm2_serving):
    from strata.common.errors import StrataError
    from strata.executor.serving import GenerationRequest

    req = GenerationRequest(
        "g", [1, 2, 3], 4, SamplingParams(), ignore_eos=True, grammar=json_schema_grammar({})
    )
    with pytest.raises(StrataError, match="ignore_eos cannot go with a grammar"):
        smollm2_serving.validate(req)


@pytest.mark.parametrize(
    "schema", [{"$ref": "#"}, {"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}]
)
def test_a_schema_no_value_meets_is_refused_not_an_empty_reply(vocab, smollm2_serving, schema):
    """Review: such a schema compiled, its first mask allowed only the end, and the reply was
    "" (not JSON) with finish_reason "stop" and a 200; now the compile refuses it, so
    ``validate`` (the 400 path) does."""
    from strata.executor.serving import GenerationRequest

    grammar = json_schema_grammar(schema)
    with pytest.raises(GrammarError, match="allows no value"):
        Constraint(vocab, grammar)
    req = GenerationRequest("g", [1, 2, 3], 4, SamplingParams(), grammar=grammar)
    with pytest.raises(GrammarError, match="allows no value"):
        smollm2_serving.validate(req)
    Constraint(vocab, json_schema_grammar({"type": "object"}))  # a satisfiable one compiles


def test_a_grammar_failing_mid_reply_says_why_in_one_line(vocab):
    """Review: llguidance's error text carries its whole parser state and grammar (kilobytes,
    sent to the client in the failed request's error); the error keeps its first line."""
    many = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            for i in range(3000)
        ]
    }
    c = Constraint(vocab, json_schema_grammar(many))
    first = vocab.tokenizer.encode('{"k', add_bos=False)[0]
    assert c.mask()[first]
    with pytest.raises(GrammarError) as e:  # past llguidance's Earley row limit (2000 items)
        c.consume([first])
    assert "max is 2000" in str(e.value) and "\n" not in str(e.value)
    assert "<state>" not in str(e.value) and len(str(e.value)) < 300


def test_masks_cover_logits_wider_than_the_vocabulary(vocab):
    """A model's output rows may outnumber its tokenizer's tokens (padded heads): the mask is
    as wide as the logits, the extra ids never allowed, however high their logits. Review:
    the vocabulary cache was keyed by tokenizer alone, so a second width got the first's."""
    tok = vocab.tokenizer
    wide = vocabulary(tok, tok.vocab_size + 64)
    assert wide.size == tok.vocab_size + 64 and vocabulary(tok).size == tok.vocab_size
    c = Constraint(wide, json_schema_grammar({"type": "object"}))
    mask = c.mask()
    assert mask.shape == (wide.size,) and not mask[tok.vocab_size :].any()
    logits = np.zeros(wide.size, np.float32)
    logits[tok.vocab_size :] = 100.0
    sampler = Sampler(SamplingParams(temperature=0), c)
    assert mask[sampler(logits)]


def test_a_batch_of_masks_equals_each_mask_alone(vocab):
    """``next_masks`` (the runner's masks of a step, computed together on llguidance's threads
    while the device runs the pass) gives each sequence exactly its own ``mask()``: fresh,
    part-way and finished grammars, two vocabulary widths' worth of rows."""
    tok = vocab.tokenizer
    fresh = Constraint(vocab, json_schema_grammar(ANSWER_SCHEMA))
    partway = Constraint(vocab, json_schema_grammar(ANSWER_SCHEMA))
    partway.consume(tok.encode('{"country": "Fr', add_bos=False))
    done = Constraint(vocab, json_schema_grammar({"enum": ["yes"]}))
    done.consume([*tok.encode('"yes"', add_bos=False), min(tok.eog_ids)])
    assert done._m.is_stopped()
    other = Constraint(vocab, json_schema_grammar({"type": "object"}))
    batch = [fresh, partway, done, other]
    got = next_masks(batch)
    want = [c.mask() for c in batch]
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert [int(m.sum()) for m in want] != [int(want[0].sum())] * 4  # the rows differ
    assert np.array_equal(next_masks([partway])[0], partway.mask())


def test_schema_errors_name_the_feature():
    with pytest.raises(GrammarError, match=r'Unimplemented keys: \["if", "then"\]'):
        json_schema_grammar({"if": {"type": "string"}, "then": {"maxLength": 2}})


# ---------------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def random_server(smollm2_gguf, tmp_path_factory):
    """``serve`` on a random-weight synthetic model (qwen3 shape, SmolLM2's tokenizer and chat
    template): its free text is gibberish, so valid JSON can only come from the grammar."""
    from conftest import make_plan_file
    from gguf_factory import write_arch_model
    from test_server import serve_process

    folder = tmp_path_factory.mktemp("structured")
    gguf = write_arch_model(folder / "qwen3.gguf", "qwen3", smollm2_gguf)
    plan = make_plan_file(str(gguf), folder / "plan.yaml", concurrency=8, context=1024)
    with serve_process(plan, folder / "stderr.txt", model="qwen3") as srv:
        yield srv


@pytest.mark.slow
def test_random_model_answers_a_nested_schema_100_of_100(random_server):
    """Acceptance 1: ``client.chat.completions.parse(response_format=Answer)`` returns a parsed
    object every time, 100 requests at concurrency 8, and 100 more streamed."""
    client = random_server.client()
    messages = [{"role": "user", "content": "Name a country and up to three of its cities."}]

    def parsed(seed: int) -> Answer:
        r = client.chat.completions.parse(
            model="qwen3",
            messages=messages,
            response_format=Answer,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(r.choices[0].message.parsed, Answer)
        return r.choices[0].message.parsed

    def streamed(seed: int) -> Answer:
        text, finish = "", None
        with client.chat.completions.stream(
            model="qwen3",
            messages=messages,
            response_format=Answer,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        ) as stream:
            for event in stream:
                if event.type == "content.delta":
                    text += event.delta
            final = stream.get_final_completion()
        finish = final.choices[0].finish_reason
        assert finish == "stop", text
        assert final.choices[0].message.parsed == Answer.model_validate_json(text)
        return final.choices[0].message.parsed

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(parsed, range(100)))
        streams = list(pool.map(streamed, range(100, 200)))
    assert len(answers) == len(streams) == 100
    assert len({a.model_dump_json() for a in answers}) > 50  # sampled: not one answer repeated
    # Unconstrained, the same model's text is not JSON at all.
    free = client.chat.completions.create(
        model="qwen3", messages=messages, temperature=0, max_tokens=40
    )
    with pytest.raises(ValueError):
        Answer.model_validate_json(free.choices[0].message.content)


# ------------------------------------------------------------- batching and speculative decoding


@pytest.fixture(scope="module")
def random_model(smollm2_gguf, tmp_path_factory):
    """(GGUF, plan): the random-weight qwen3-shape model, resident, 6 sequences."""
    from conftest import make_plan_file
    from gguf_factory import write_arch_model

    folder = tmp_path_factory.mktemp("constrained")
    gguf = write_arch_model(folder / "qwen3.gguf", "qwen3", smollm2_gguf)
    return gguf, make_plan_file(str(gguf), folder / "plan.yaml", context=512, concurrency=6)


@pytest.mark.parametrize("kind", ["prompt_lookup", "self"])
def test_speculative_decoding_under_a_grammar_keeps_the_ids(kind, random_model):
    """Greedy constrained requests batched together (each with its own grammar state), served
    with a drafter whose drafts the grammar checks: the same ids as without speculation, every
    answer valid JSON of the schema ending in an end-of-generation token, and drafts were
    proposed and verified."""
    from strata.executor.tokenizer import GGUFTokenizer
    from test_speculative import _run

    grammar = json_schema_grammar(Answer.model_json_schema())
    prompts = [[7, 8, 9] * 6, [100, 200, 300, 400] * 4, list(range(500, 520))]

    def reqs(tag: str) -> list:
        from strata.executor.serving import GenerationRequest

        return [
            GenerationRequest(f"{tag}{i}", p, 300, SamplingParams(), grammar=grammar)
            for i, p in enumerate(prompts)
        ]

    gguf, plan = random_model
    plain, _, _ = _run(plan, reqs("p"))
    spec, _, stats = _run(plan, reqs("s"), kind)
    assert stats["proposed"] > 0
    tok = GGUFTokenizer.from_gguf(gguf)
    for i in range(len(prompts)):
        assert spec[f"s{i}"] == plain[f"p{i}"]
        ids = plain[f"p{i}"]
        assert ids[-1] in tok.eog_ids, tok.decode(ids)
        Answer.model_validate_json(tok.decode(ids[:-1]))


@pytest.mark.slow
def test_a_grammar_failing_mid_reply_is_the_request_s_400(random_server):
    """A schema that compiles but that llguidance's parser limits stop after the first token
    (an anyOf of 3000 objects: 'Current row has 3000 items') ends that request with a 400 naming
    the grammar, streamed or not; the server goes on serving."""
    schema = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            for i in range(3000)
        ]
    }
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "max_tokens": 20,
    }
    r = random_server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert "the request's grammar failed" in r.json()["error"]["message"]
    ok = random_server.post("/v1/chat/completions", {"messages": body["messages"], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_chat_only_fields_on_completions_and_empty_content_are_refused():
    """Fields a request would expect honoured are refused, not dropped: ``tools`` and
    ``tool_choice`` on /v1/completions, and a message whose content is an empty list."""
    from pydantic import ValidationError

    for name, value in (("tools", []), ("tool_choice", "auto")):
        body = CompletionRequest.model_validate({"prompt": "x", name: value})
        with pytest.raises(APIError) as e:
            body.check_unsupported()
        assert e.value.status == 400 and e.value.param == name
        assert "/v1/chat/completions" in e.value.message
    with pytest.raises(ValidationError, match="content is an empty list"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": []}]})


@pytest.mark.parametrize("choice", [5, [1], "sometimes", True])
def test_a_tool_choice_of_another_kind_names_the_choices(choice):
    from pydantic import ValidationError

    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": choice}
    with pytest.raises(ValidationError, match='is not a tool_choice: give "none", "auto"'):
        ChatCompletionRequest.model_validate(body)
