"""The SentencePiece ("llama") GGUF tokenizer rebuilt from metadata, token for token against llama.cpp's
algorithm and transformers' own GGUF conversion.

No network: a small SentencePiece-style vocabulary is trained here with `tokenizers` (BPE over whole
strings with "▁" for spaces, no pre-split, as SentencePiece BPE works), laid out as a Llama GGUF vocabulary
(<unk> <s> </s>, the 256 <0xNN> byte tokens, then the pieces with score = -rank) and written as GGUF
tokenizer metadata with `gguf`. The llama.cpp reference below is an independent, deliberately naive
re-statement of llm_tokenizer_spm: merge the adjacent pair whose concatenation is a token with the best
score (ties: leftmost), repeat; characters no token covers become their UTF-8 bytes.
"""

from __future__ import annotations

import random

import pytest

from kernel_lab.models import gguf as gguf_module
from kernel_lab.models.gguf_file import GGUFFile
from kernel_lab.models.tokenizer import SPACE_MARKER, build_gguf_tokenizer, merges_by_score

tokenizers = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

CONTROL, NORMAL, UNKNOWN, BYTE = 3, 1, 2, 6
WORDS = ["the", "model", "token", "serving", "kernel", "cache", "attention", "über", "naïve", "café", "Straße",
         "привет", "мир", "日本語", "テキスト", "中文", "مرحبا", "שלום", "ελληνικά", "don't", "it's", "x86_64",
         "GPU", "HBM3e", "fp16", "Δt", "½", "π≈3.14159"]
RARE = ["🙂", "👩‍💻", "🚀", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\u00a0", "\u200b", "ǅ", "ꙮ", "🇫🇷", "\x01", "~", "\\", "{", "}"]
GAPS = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n", "    "]


def random_text(rng: random.Random, rare: bool) -> str:
    parts = []
    for _ in range(rng.randint(1, 12)):
        pick = rng.random()
        if pick < 0.55:
            parts.append(rng.choice(WORDS))
        elif pick < 0.7:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
        elif pick < 0.8 and rare:
            parts.append(rng.choice(RARE))
        else:
            parts.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz.,!?;:-'\"()") for _ in range(rng.randint(1, 6))))
        parts.append(rng.choice(GAPS) if rng.random() < 0.3 else " ")
    text = "".join(parts)
    if rng.random() < 0.3:
        text = rng.choice(GAPS) + text  # leading whitespace: where the prefix-space rules show
    return text if rng.random() < 0.5 else text.rstrip()


def texts(count: int, seed: int, rare: bool = True) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, rare) for _ in range(count)]


def train_vocab(vocab_size: int = 700) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a Llama-layout SentencePiece vocabulary trained on generated text
    without the RARE characters, so those reach the byte fallback."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    model = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    model.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARKER), normalizers.Replace(" ", SPACE_MARKER)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    model.train_from_iterator(texts(1500, 1, rare=False), trainer)
    learned = sorted(model.get_vocab().items(), key=lambda item: item[1])
    pieces = [token for token, _ in learned if token not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * (3 + 256) + [-float(rank) for rank in range(len(pieces))]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    return tokens, scores, types


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    tokens, scores, types = train_vocab()
    path = tmp_path_factory.mktemp("spm") / "spm-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, tokens, scores


@pytest.fixture(scope="module")
def ours(spm_gguf):
    path, _, _ = spm_gguf
    meta = gguf_module.tokenizer_metadata(GGUFFile(path).metadata)
    assert meta["model"] == "llama" and meta["add_space_prefix"] is True
    return build_gguf_tokenizer(meta)


def llama_cpp_spm(text: str, tokens: list[str], scores: list[float], add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SPM tokenisation of raw text (no BOS), restated naively."""
    if not text:
        return []  # llama.cpp makes no fragment of empty text, so no prefix space either
    ids = {token: index for index, token in enumerate(tokens)}
    text = (" " + text if add_space_prefix else text).replace(" ", SPACE_MARKER)
    symbols = list(text)  # code points, as llama.cpp's UTF-8 character split
    while True:
        best = None
        for i in range(len(symbols) - 1):
            merged = ids.get(symbols[i] + symbols[i + 1])
            if merged is not None and (best is None or scores[merged] > scores[best[1]]):
                best = (i, merged)
        if best is None:
            break
        i, _ = best
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for symbol in symbols:
        if symbol in ids:
            out.append(ids[symbol])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in symbol.encode("utf-8"))
    return out


CASES = texts(3000, 7) + ["", " ", "  ", "\n", "a", " a", "a ", "hello  world", "🙂", "1234567890", "x\n\ny",
                          "ab\tcd", "  leading", "trailing  "]


def test_generated_strings_cover_what_they_claim():
    joined = "".join(CASES)
    assert len(CASES) >= 3000
    for needle in ("🙂", "👩\u200d💻", "  ", "\n\n", "\t", "日本語", "привет"):
        assert needle in joined
    assert sum(c[:1].isspace() for c in CASES if c) > 300 and any(c[:1].isdigit() for c in CASES)


def test_matches_llama_cpp_token_for_token(ours, spm_gguf):
    _, tokens, scores = spm_gguf
    byte_fallbacks = 0
    for text in CASES:
        expected = [1] + llama_cpp_spm(text, tokens, scores)  # add_bos_token
        got = ours.encode(text).ids
        assert got == expected, (text, got, expected)
        byte_fallbacks += any(3 <= i < 259 for i in got)
    assert byte_fallbacks > 100, "the byte fallback must be exercised"


def test_decode_round_trips(ours):
    for text in CASES:
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == text, text
        assert ours.decode(ours.encode(text, add_special_tokens=False).ids) == text


def test_special_tokens_stay_whole_and_restart_the_prefix_space(ours, spm_gguf):
    _, tokens, scores = spm_gguf
    got = ours.encode("hi</s>there").ids
    # llama.cpp prefixes a space to the text after a special token too (is_prev_special)
    assert got == [1] + llama_cpp_spm("hi", tokens, scores) + [2] + llama_cpp_spm("there", tokens, scores)


def test_without_space_prefix(spm_gguf):
    path, tokens, scores = spm_gguf
    meta = gguf_module.tokenizer_metadata(GGUFFile(path).metadata)
    tokenizer = build_gguf_tokenizer({**meta, "add_space_prefix": False, "add_bos_token": False})
    for text in CASES[:300]:
        assert tokenizer.encode(text).ids == llama_cpp_spm(text, tokens, scores, add_space_prefix=False), text
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_agrees_with_transformers_gguf_conversion_except_on_leading_spaces(ours, spm_gguf):
    """transformers builds its own tokenizer from the same file. Where the text starts with a space its
    Metaspace step does not add the prefix "▁" (SentencePiece and llama.cpp do); everywhere else the
    two agree token for token."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    path, _, _ = spm_gguf
    architecture, tokenizer_dict, _ = mapping.get_gguf_tokenizer(str(path))
    hf, _ = mapping.convert_gguf_tokenizer(architecture, tokenizer_dict)
    differ = 0
    for text in CASES:
        ids, hf_ids = ours.encode(text, add_special_tokens=False).ids, hf.encode(text, add_special_tokens=False).ids
        if text.startswith(" "):
            differ += ids != hf_ids
        else:
            assert ids == hf_ids, (text, ids, hf_ids)
    assert differ > 0, "the documented difference on leading spaces should show"


def test_merges_follow_scores():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert merges_by_score(tokens, scores) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_bad_metadata_is_refused_by_name(spm_gguf):
    _, tokens, _ = spm_gguf
    with pytest.raises(ValueError, match="needs tokenizer.ggml.scores"):
        build_gguf_tokenizer({"model": "llama", "tokens": tokens, "scores": None})
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert' is not supported"):
        build_gguf_tokenizer({"model": "bert", "tokens": tokens})
