"""The tokenizer a GGUF file describes, as `tokenizer.json` + `tokenizer_config.json`, built with `tokenizers`.

Byte-level BPE (`tokenizer.ggml.model = gpt2`, what Llama 3, Qwen2/3 and SmolLM files carry): the
vocabulary and merges from the file, the pre-tokenizer split named by `tokenizer.ggml.pre`. SentencePiece
(`llama`, what Llama 2, Mistral v0.1, Gemma and Phi-3 files carry): the pieces and their scores, merged
best score first with byte fallback (llama.cpp's SPM algorithm), a leading space unless
`tokenizer.ggml.add_space_prefix` is false (Gemma). Gemma 4 (`gemma4`): BPE with the file's merges over
SentencePiece-spelled text, with byte fallback. Either way tokens marked CONTROL are special tokens
and USER_DEFINED ones plain added tokens, with BOS/EOS, `add_bos_token`, and the chat template from
`tokenizer.chat_template`. Built the way transformers builds it from the same file (its GGUF loader, and
the original checkpoint's tokenizer, are the references the tests compare against).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from pdserve.engine.model.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4        # llama.cpp's token types
SPACE = "\u2581"                    # SentencePiece's spelling of a space
# NOTE: llama.cpp ends generation on any of these when the file marks them CONTROL (llama-vocab.cpp)
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<|end_of_text|>", "<EOT>", "<|return|>", "<turn|>")

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
# NOTE: these split like GPT-2's byte-level regex, as transformers does. llama.cpp also isolates each
# digit for smollm/starcoder/refact, which only changes whitespace runs just before a digit.
GPT2_SPLIT = ("default", "gpt2", "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    tokenizer_json: str
    tokenizer_config: dict
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    end_of_generation_ids: tuple[int, ...]     # eos, eot, eom and the end-of-turn tokens llama.cpp stops on


def tokenizer_files(f: GGUFFile, context_length: int) -> TokenizerFiles:
    """Raises GGUFError naming the file and key for a tokenizer this cannot build."""
    kind = f.string("tokenizer.ggml.model")
    if kind not in BACKENDS:
        raise f.error(f"tokenizer.ggml.model = {kind!r} is not supported (byte-level BPE 'gpt2', SentencePiece "
                      f"'llama' or Gemma 4's 'gemma4')")
    tokens = f.strings("tokenizer.ggml.tokens")
    types = _token_types(f, len(tokens))
    ids = {name: _token_id(f, f"tokenizer.ggml.{name}_token_id", len(tokens))
           for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    flags = {key: _flag(f, f"tokenizer.ggml.{key}", default=kind != "gpt2" and key == "add_bos_token")
             for key in ("add_bos_token", "add_eos_token")}
    backend = BACKENDS[kind](f, tokens, types, ids, flags)
    config = _tokenizer_config(f, tokens, ids, flags, context_length)
    eog = [ids["eos"], ids["eot"], ids["eom"]] + [i for i, t in enumerate(tokens)
                                                  if t in END_OF_GENERATION and types[i] == CONTROL]
    return TokenizerFiles(backend.to_str(), config, ids["bos"], ids["eos"], ids["padding"],
                          tuple(dict.fromkeys(i for i in eog if i is not None)))


def _backend(f: GGUFFile, tokens: list[str], types: list[int], ids: dict, flags: dict) -> Tokenizer:
    alphabet = _byte_alphabet()
    vocab = {_respell(t, alphabet): i for i, t in enumerate(tokens)}
    backend = _file_merges_bpe(f, vocab, fuse_unk=False, byte_fallback=False)
    _add_tokens(backend, tokens, types, ids, lambda token: set(token) <= alphabet)
    backend.pre_tokenizer = _pre_tokenizer(f.string("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = _post_processor(tokens, ids, flags)
    return backend


def _sentencepiece(f: GGUFFile, tokens: list[str], types: list[int], ids: dict, flags: dict) -> Tokenizer:
    scores = f.value("tokenizer.ggml.scores", [0.0] * len(tokens))
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise f.error(f"tokenizer.ggml.scores must hold one score per token ({len(tokens)})")
    if f.architecture.startswith("gemma"):       # NOTE: Gemma stores runs of spaces as spaces; merges in file order
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    unknown = tokens[ids["unknown"]] if ids["unknown"] is not None else None
    backend = Tokenizer(models.BPE(vocab, _score_merges(vocab, dict(zip(tokens, scores))), unk_token=unknown,
                                   fuse_unk=True, byte_fallback=True))
    prefix = _flag(f, "tokenizer.ggml.add_space_prefix", default=True)
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    backend.decoder = _spaces_decoder(prefix)
    _add_tokens(backend, tokens, types, ids, lambda token: True)
    backend.post_processor = _post_processor(tokens, ids, flags)
    return backend


def _gemma4(f: GGUFFile, tokens: list[str], types: list[int], ids: dict, flags: dict) -> Tokenizer:
    """BPE over raw UTF-8 with the file's merges, spaces spelled as SentencePiece's, byte fallback (transformers'
    GemmaTokenizer), the text split only at runs of newlines (llama.cpp's gemma4 pre-tokenizer)."""
    unknown = tokens[ids["unknown"]] if ids["unknown"] is not None else None
    backend = _file_merges_bpe(f, {t: i for i, t in enumerate(tokens)}, unk_token=unknown, fuse_unk=True,
                               byte_fallback=True)
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    backend.decoder = _spaces_decoder(prefix=False)
    _add_tokens(backend, tokens, types, ids, lambda token: True)
    backend.post_processor = _post_processor(tokens, ids, flags)
    return backend


BACKENDS = {"gpt2": _backend, "llama": _sentencepiece, "gemma4": _gemma4}


def _file_merges_bpe(f: GGUFFile, vocab: dict[str, int], **options) -> Tokenizer:
    try:
        return Tokenizer(models.BPE(vocab, _merges(f), **options))
    except Exception as e:  # NOTE: the Rust side raises a bare Exception
        raise f.error(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from None


def _spaces_decoder(prefix: bool) -> decoders.Decoder:
    """SentencePiece-spelled spaces back to spaces, byte pieces back to bytes; the leading space a `prefix` added
    stripped."""
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)


def _score_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the best-scored piece's first: SentencePiece's BPE order as
    merges (transformers' `generate_merges`)."""
    merges = []
    for piece, score in scores.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges += [(left, right, score) for left, right in sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_tokens(backend: Tokenizer, tokens: list[str], types: list[int], ids: dict, spelled) -> None:
    """CONTROL tokens and BOS/EOS/UNK/PAD as special tokens, USER_DEFINED ones as plain added tokens (kept whole
    in text, as llama.cpp matches them); `spelled(token)`: whether the vocabulary can hold it as it is."""
    specials = {i for i, t in enumerate(types) if t == CONTROL and spelled(tokens[i])}
    specials |= {i for i in (ids["bos"], ids["eos"], ids["unknown"], ids["padding"])
                 if i is not None and spelled(tokens[i])}
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(specials)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == USER_DEFINED and spelled(tokens[i])])


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    if name in SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLITS[name]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if name not in GPT2_SPLIT:
        logger.warning("tokenizer.ggml.pre = %r is not one pdserve knows; splitting text like GPT-2", name)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _post_processor(tokens: list[str], ids: dict, flags: dict) -> processors.TemplateProcessing:
    bos = [tokens[ids["bos"]]] if flags["add_bos_token"] and ids["bos"] is not None else []
    eos = [tokens[ids["eos"]]] if flags["add_eos_token"] and ids["eos"] is not None else []
    special = [(tokens[ids[k]], ids[k]) for k, used in (("bos", bos), ("eos", eos)) if used]
    return processors.TemplateProcessing(single=bos + ["$A"] + eos, pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos,
                                         special_tokens=special)


def _tokenizer_config(f: GGUFFile, tokens: list[str], ids: dict, flags: dict, context_length: int) -> dict:
    def text(key: str) -> str | None:
        return tokens[ids[key]] if ids[key] is not None else None

    return {"add_bos_token": flags["add_bos_token"], "add_eos_token": flags["add_eos_token"],
            "bos_token": text("bos"), "eos_token": text("eos"), "unk_token": text("unknown"),
            "pad_token": text("padding"), "chat_template": _chat_template(f),
            "clean_up_tokenization_spaces": False, "model_max_length": context_length,
            "tokenizer_class": "PreTrainedTokenizerFast"}


def _chat_template(f: GGUFFile) -> str | list[dict] | None:
    default = f.value("tokenizer.chat_template")
    named = [{"name": key.removeprefix("tokenizer.chat_template."), "template": f.string(key)}
             for key in f.keys() if key.startswith("tokenizer.chat_template.")]
    if not named:
        return default
    return ([{"name": "default", "template": default}] if default else []) + named


def _merges(f: GGUFFile) -> list[tuple[str, str]]:
    merges = [tuple(m.split(" ")) for m in f.strings("tokenizer.ggml.merges")]
    bad = next((" ".join(m) for m in merges if len(m) != 2), None)
    if bad is not None:
        raise f.error(f"tokenizer.ggml.merges: {bad!r} is not two tokens separated by one space")
    return merges


def _token_types(f: GGUFFile, count: int) -> list[int]:
    types = f.value("tokenizer.ggml.token_type", [1] * count)
    if not isinstance(types, list) or len(types) != count:
        raise f.error(f"tokenizer.ggml.token_type has {len(types) if isinstance(types, list) else 'no'} "
                      f"entries for {count} tokens in tokenizer.ggml.tokens")
    return types


def _token_id(f: GGUFFile, key: str, count: int) -> int | None:
    if key not in f:
        return None
    value = f.integer(key)
    if not 0 <= value < count:
        raise f.error(f"{key} = {value} is outside tokenizer.ggml.tokens (0..{count - 1})")
    return value


def _flag(f: GGUFFile, key: str, default: bool = False) -> bool:
    value = f.value(key, default)
    if not isinstance(value, bool):
        raise f.error(f"metadata {key} = {value!r} is not a boolean")
    return value


def _respell(token: str, alphabet: frozenset[str]) -> str:
    """A token written in the byte alphabet stays; any other is spelled byte by byte (as transformers does)."""
    if set(token) <= alphabet:
        return token
    return "".join(_byte_to_char()[b] for b in token.encode("utf-8"))


@cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (`bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


@cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_to_char().values())
