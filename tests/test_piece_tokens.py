"""Chat prompts tokenized piece by piece (engine/admit/piece_tokens.py): the same tokens as the
whole text, for random conversations; a conversation re-sent with one more turn tokenizes only
that turn; tokenizers whose parts do not add up are refused, or turned off by the check."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from mlxd.engine.admit.piece_tokens import VERIFY, PieceTokenizer

CORPUS = ["def parse(self, token: str) -> int:\n    return len(token)  # ü ß 日本 ✓",
          "The quick brown fox jumps over the lazy dog. " * 3, "   indented\n\n\tline",
          "<tool_call>{\"name\": \"Read\", \"arguments\": {\"path\": \"a.py\"}}</tool_call>"]


def chat_text(rng: random.Random, turns: int) -> list[dict]:
    alphabet = "ab cd\n\t<|>/{}\"'éü日✓ _-=.,:;" + "xyz" * 5
    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))
    msgs = [{"role": "system", "content": text()}]
    for _ in range(turns):
        msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return msgs


@pytest.fixture(scope="module")
def hf(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def test_pieces_give_the_tokens_of_the_whole_prompt(hf):
    pieces = PieceTokenizer.for_tokenizer(hf)
    assert pieces is not None
    rng = random.Random(5)
    for _ in range(60):
        text = hf.apply_chat_template(chat_text(rng, rng.randrange(1, 6)), tokenize=False,
                                      add_generation_prompt=True)
        # a piece boundary glued to text that looks like part of a marker
        text += rng.choice(["", "<|im_", "|>", " <|im_end|>x", "<|im_end|><|im_end|>"])
        assert pieces.encode(text) == hf.encode(text, add_special_tokens=False)
        assert pieces.encode(text) == hf.encode(text, add_special_tokens=False)  # kept pieces
    assert pieces.checked("x") is not None and pieces.on


class Counting:
    """A backend that counts the characters it is asked to tokenize."""

    def __init__(self, backend) -> None:
        self.backend, self.chars = backend, 0

    def encode_batch(self, parts, add_special_tokens):
        self.chars += sum(len(p) for p in parts)
        return self.backend.encode_batch(parts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_a_conversation_sent_again_with_one_more_turn_tokenizes_only_that_turn(hf):
    counting = Counting(hf.backend_tokenizer)
    pieces = PieceTokenizer(counting)
    msgs = [{"role": "system", "content": "You are an agent. " * 200},
            {"role": "user", "content": "Fix the bug in parse(). " * 30}]
    first = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    pieces.encode(first)
    assert counting.chars >= 4000
    msgs += [{"role": "assistant", "content": "Reading the file."},
             {"role": "user", "content": "file contents: def parse(self): pass " * 40}]
    second = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    counting.chars = 0
    assert pieces.encode(second) == hf.encode(second, add_special_tokens=False)
    assert counting.chars < len(second) - len(first) + 100  # the new turn, and small pieces


def trained(pre_tokenizer, added: list[AddedToken]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        special_tokens=["<|im_start|>"]))
    tok.add_special_tokens(added)
    return tok


class Fast:
    def __init__(self, backend) -> None:
        self.backend_tokenizer = backend


def test_tokenizers_whose_parts_do_not_add_up_are_refused():
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert PieceTokenizer.for_tokenizer(Fast(trained(byte_level, [AddedToken("<e>")]))) \
        is not None
    for token in (AddedToken("<e>", lstrip=True), AddedToken("<e>", rstrip=True),
                  AddedToken("<e>", single_word=True)):
        assert PieceTokenizer.for_tokenizer(Fast(trained(byte_level, [token]))) is None
    first = pre_tokenizers.Metaspace(prepend_scheme="first")
    assert PieceTokenizer.for_tokenizer(Fast(trained(first, [AddedToken("<e>")]))) is None
    assert PieceTokenizer.for_tokenizer(object()) is None  # a slow tokenizer


def test_the_first_prompts_are_checked_whole_and_a_difference_turns_the_pieces_off():
    tok = trained(pre_tokenizers.Metaspace(prepend_scheme="first"), [AddedToken("<e>")])
    pieces = PieceTokenizer(tok)  # past the refusal: the check must catch it
    text = "<|im_start|>hello world<e>def parse<e> more words"
    assert pieces.encode(text) != tok.encode(text, add_special_tokens=False).ids
    got = pieces.checked(text)
    assert got == tok.encode(text, add_special_tokens=False).ids and not pieces.on
    assert pieces.checked(text) is None  # off for good: the caller tokenizes whole
    same = PieceTokenizer(trained(pre_tokenizers.ByteLevel(add_prefix_space=False),
                                  [AddedToken("<e>")]))
    for _ in range(VERIFY + 2):
        assert same.checked(text) is not None
    assert same.on and same.verified == VERIFY
