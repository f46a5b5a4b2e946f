"""Tokenizers: built from GGUF metadata, and loaded from a Hugging Face directory for the engine.

A GGUF file does not carry a tokenizer.json; it carries the vocabulary, the token types and, by
`tokenizer.ggml.model`, either merges and a `tokenizer.ggml.pre` split ("gpt2": byte-level BPE) or scores
("llama": SentencePiece BPE with byte fallback, Llama 2 / Mistral files; Gemma files, whose scores
and multi-space tokens llama.cpp and transformers treat specially, are not checked yet). `build_gguf_tokenizer`
rebuilds the equivalent `tokenizers` pipeline from those, and `export_hf_directory` saves it as
tokenizer.json so that every later load (ours, transformers', vLLM's) reads the same file.

SentencePiece semantics followed are llama.cpp's (llm_tokenizer_spm), which are SentencePiece's own:
  - text becomes "▁" + text with every space as "▁" (add_space_prefix, default on), after each special token
    too; no other normalisation, whitespace runs and newlines kept;
  - pieces merge greedily, best score first: as BPE with the merges ranked by the merged token's score;
  - a character no token covers becomes its UTF-8 bytes as the <0xNN> tokens.
transformers' own GGUF Llama tokenizer differs on text that starts with a space: its Metaspace step
prepends "▁" only to text not already starting with one (projects/09_engine/test_gguf_spm_tokenizer.py
shows both).

`Tokenizer` is what the engine uses: encoding with special tokens added the way vLLM adds them (the
tokenizer's own post-processor), the chat template rendered with jinja2 the way transformers renders it,
and streaming detokenisation.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

# Pre-tokenisation per `tokenizer.ggml.pre`. The regexes are llama.cpp's (and the original tokenizers').
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_PRES = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GPT2_PRES = {None, "default", "gpt2", "gpt-2", "mpt", "olmo"}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPACE_MARKER = "\u2581"  # "▁", SentencePiece's space


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    if pre in _SPLIT_REGEX_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX_PRES[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    raise ValueError(
        f"unknown GGUF pre-tokenizer {pre!r}: tokenising with a guessed split would silently change "
        "token ids; "
        f"known: {sorted(p for p in _DIGIT_SPLIT_PRES | set(_SPLIT_REGEX_PRES) | _GPT2_PRES if p)}"
    )


def _byte_level_bpe(meta: dict):
    """tokenizer.ggml.model "gpt2": BPE over byte-level characters with the file's merges and split."""
    from tokenizers import Tokenizer, decoders, models, processors

    tokens, merges = meta["tokens"], meta.get("merges") or []
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("pre"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, [processors.ByteLevel(trim_offsets=False)]


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens, best
    merged-token score first (ties: lower token id first), so that BPE's lowest-rank-first equals
    SentencePiece's best-score-first."""
    ids = {token: index for index, token in enumerate(tokens)}
    merges = []
    for index in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        token = tokens[index]
        merges.extend((token[:cut], token[cut:]) for cut in range(1, len(token))
                      if token[:cut] in ids and token[cut:] in ids)
    return merges


def _sentencepiece_bpe(meta: dict):
    """tokenizer.ggml.model "llama": SentencePiece BPE with byte fallback (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens, scores = meta["tokens"], meta.get("scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("a 'llama' (SentencePiece) GGUF tokenizer needs tokenizer.ggml.scores, one per token; "
                         f"got {None if scores is None else len(scores)} for {len(tokens)} tokens")
    unk_id = meta.get("unknown_token_id")
    bpe = models.BPE(vocab={token: index for index, token in enumerate(tokens)},
                     merges=merges_by_score(tokens, scores), byte_fallback=True, fuse_unk=True,
                     unk_token=tokens[unk_id] if unk_id is not None else None)
    tokenizer = Tokenizer(bpe)
    add_prefix = meta.get("add_space_prefix", True)
    spaces = [normalizers.Replace(" ", SPACE_MARKER)]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARKER)] * add_prefix + spaces)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE_MARKER, " "), decoders.ByteFallback(),
                                           decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * add_prefix)
    return tokenizer, []


_GGUF_TOKENIZER_MODELS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def build_gguf_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` from GGUF tokenizer metadata (see gguf.tokenizer_metadata), by
    tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE with byte fallback)."""
    from tokenizers import AddedToken, processors

    builder = _GGUF_TOKENIZER_MODELS.get(meta.get("model"))
    if builder is None:
        raise ValueError(f"GGUF tokenizer.ggml.model {meta.get('model')!r} is not supported; supported: "
                         f"{sorted(_GGUF_TOKENIZER_MODELS)}")
    tokens = meta["tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer, steps = builder(meta)

    bos_id, eos_id = meta.get("bos_token_id"), meta.get("eos_token_id")
    add_bos = bool(meta.get("add_bos_token")) and bos_id is not None
    add_eos = bool(meta.get("add_eos_token")) and eos_id is not None
    if add_bos or add_eos:
        bos, eos = (tokens[bos_id] if add_bos else None), (tokens[eos_id] if add_eos else None)
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = single + " " + " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        specials = [(t, vocab[t]) for t in dict.fromkeys(x for x in (bos, eos) if x is not None)]
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials))
    tokenizer.post_processor = processors.Sequence(steps)

    types = meta.get("token_types") or [1] * len(tokens)
    specials = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
    # The special ids named in the metadata are special even when a file types them as normal.
    specials |= {meta.get(k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
                 if meta.get(k) is not None}
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i in sorted(specials)])
    user_defined = [AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    if user_defined:
        tokenizer.add_tokens(user_defined)
    return tokenizer


def tokenizer_config(meta: dict) -> tuple[dict, dict]:
    """(tokenizer_config.json, special_tokens_map.json) for a GGUF tokenizer."""
    tokens = meta["tokens"]

    def name(key):
        index = meta.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special_map = {k: v for k, v in {
        "bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"), "pad_token": name("padding_token_id"),
    }.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": bool(meta.get("add_bos_token")),
        "add_eos_token": bool(meta.get("add_eos_token")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("context_length") or 2048),
    }
    if meta.get("chat_template"):
        config["chat_template"] = meta["chat_template"]
    return config, special_map


# ------------------------------------------------------------------------------------------------ runtime
def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _compile_chat_template(source: str):
    """Compile a chat template the way transformers does (sandboxed, trim_blocks + lstrip_blocks)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """The engine's tokenizer: a `tokenizers.Tokenizer` plus the special-token and chat-template facts of
    tokenizer_config.json and the EOS ids of generation_config.json."""

    has_vocabulary = True

    def __init__(self, backend, config: dict | None = None, generation_config: dict | None = None,
                 model_config: dict | None = None):
        self.backend = backend
        self.config = dict(config or {})
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._token_id(self.config.get("bos_token"))
        self.eos_token_id = self._token_id(self.config.get("eos_token"))
        self.pad_token_id = self._token_id(self.config.get("pad_token"))
        eos_ids: set[int] = set()
        for source in (generation_config or {}, model_config or {}):
            value = source.get("eos_token_id")
            eos_ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: set[int] = eos_ids
        self.chat_template_source: str | None = self.config.get("chat_template")
        self._chat_template = None
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: set[int] = {i for i, tok in added.items() if tok.special}

    def _token_id(self, token) -> int | None:
        if isinstance(token, dict):  # the AddedToken form of tokenizer_config.json
            token = token.get("content")
        return self.backend.token_to_id(token) if token else None

    @classmethod
    def from_directory(cls, path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{str(path)!r} has no tokenizer.json "
                                    "(only fast tokenizers are supported)")

        def read(name):
            f = path / name
            return json.loads(f.read_text()) if f.is_file() else {}

        config = read("tokenizer_config.json")
        for key, value in read("special_tokens_map.json").items():
            config.setdefault(key, value)
        if "chat_template" not in config and (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        return cls(Backend.from_file(str(tokenizer_file)), config, read("generation_config.json"),
                   read("config.json"))

    # -------------------------------------------------------------------------------------------- text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: the longest vocabulary entry. Byte-level entries hold
        one character per byte, so a token decodes to at most that many characters, and a text of C
        characters has at least C / max_token_chars tokens (the server bounds prompts with it before
        tokenizing them). That holds while no normalizer deletes characters: byte-level BPE has none, and
        the SentencePiece one here only prepends and replaces spaces one for one."""
        return max(1, max(map(len, self.backend.get_vocab(with_added_tokens=True))))

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -------------------------------------------------------------------------------------------- chat
    def set_chat_template(self, source: str) -> None:
        """Use `source` (Jinja text) in place of the model's template. Compiled now, so a template that
        does not parse fails here (ValueError) rather than on the first chat."""
        import jinja2

        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template must be non-empty Jinja text")
        try:
            compiled = _compile_chat_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not parse: {exc} (line {exc.lineno})") from exc
        self.chat_template_source, self._chat_template = source, compiled

    def render_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template_source:
            raise ValueError("this model's tokenizer has no chat template; pass a plain prompt instead")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if self._chat_template is None:
            self._chat_template = _compile_chat_template(self.chat_template_source)
        specials = {k: self.config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        specials = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in specials.items()}
        specials = {k: v for k, v in specials.items() if v is not None}
        return self._chat_template.render(messages=list(messages),
                                          add_generation_prompt=add_generation_prompt, **specials, **kwargs)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True,
                            **kwargs):
        """Token ids (or the text, with tokenize=False) of a conversation. The rendered template already
        holds every special token it wants, so encoding adds none (as transformers and vLLM do)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids without re-decoding all of it every step.

    Decodes a short window before the newest tokens and emits only the part past what was already
    emitted; waits while the window ends in an incomplete UTF-8 sequence (a replacement character)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Context from the prompt so a first token's leading space decodes as it would mid-text.
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""


class TokenIdsOnly:
    """The tokenizer of a random-weight model: prompts are token ids and nothing is detokenised."""

    chat_template_source = None
    max_token_chars = 1         # encode refuses every text anyway
    all_special_ids: set[int] = set()
    has_vocabulary = False      # no token texts: no grammar can be compiled against it

    def __init__(self, hf_config: dict):
        eos = hf_config.get("eos_token_id")
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.bos_token_id = hf_config.get("bos_token_id")
        self.vocab_size = int(hf_config["vocab_size"])

    def encode(self, text, add_special_tokens=True):
        raise TypeError("a random-weight model has no tokenizer: pass prompts as token ids")

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        raise TypeError("a random-weight model has no chat template")
