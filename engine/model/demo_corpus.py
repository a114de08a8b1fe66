"""The demo checkpoint's tokenizer: a byte-level BPE trained on a built-in corpus."""
from __future__ import annotations

import itertools
import json

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# NOTE: the pre-tokenizer split of Qwen2 / Llama 3 (single digits, contractions, code punctuation).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages and messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '# Tools\\n\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' + (tool | tojson) }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- elif messages and messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role not in ('system', 'user', 'assistant', 'tool') %}\n"
    "        {{- raise_exception('unknown role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "    {%- if not (loop.first and message.role == 'system') %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}\n"
    "        {%- for call in message.tool_calls or [] %}\n"
    "            {{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

ENGLISH = """\
The quick brown fox jumps over the lazy dog. A language model reads a prompt, one token at a time,
and predicts the next token. Prefill turns the whole prompt into a key-value cache in one pass;
decode then produces one token per step, reading every cached key and value again.
Prefill is bound by compute, decode by memory bandwidth, so the two phases like different hardware.
When a long prompt arrives on a busy server, every running stream pauses while it is processed.
Splitting the phases across two devices keeps the decode rhythm steady: inter-token latency stays low.
It's a simple idea, but the details matter: blocks, queues, priorities and back-pressure.
She said, "We'll measure time to first token, throughput and the 99th percentile latency."
Weather report: cloudy in the morning, light rain at noon, clear skies by evening; 18 degrees.
Recipe: mix 200 g of flour, 2 eggs and 300 ml of milk; rest the batter for 30 minutes, then fry.
Why do we cache? Because recomputing attention over 4096 positions for every new token is wasteful.
They've shipped version 1.2.3 on Monday, 3 March 2025, after 1,024 tests passed in 57.9 seconds.
"""

CODE = '''\
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype) * weight


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free = list(range(num_blocks))
        self.block_size = block_size

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of blocks: need {n}, have {len(self.free)}")
        return [self.free.pop() for _ in range(n)]

for i, token in enumerate(tokens):
    print(i, token, end="\\n")

{"model": "demo", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}

#include <stdio.h>
int main(void) { for (int i = 0; i < 10; ++i) printf("%d\\n", i * i); return 0; }

$ curl -s http://localhost:8000/v1/completions -d '{"prompt": "Once upon a time", "max_tokens": 32}'
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC;
'''

MULTILINGUAL = """\
Français : l'été dernier, nous sommes allés à la mer ; le café était très bon, merci beaucoup !
Deutsch: Größere Modelle brauchen mehr Speicher. Über die Brücke gehen, Straße überqueren, schön.
Español: ¿Dónde está la estación? ¡Mañana será un día fantástico! El niño comió piña.
Português: não, obrigado; a informação está disponível à noite. Ação e coração.
Русский: Привет, мир! Быстрая коричневая лиса прыгает через ленивую собаку.
Ελληνικά: Καλημέρα κόσμε, η γλώσσα είναι όμορφη.
中文：你好，世界！语言模型一次生成一个词元。今天天气很好，我们去公园散步吧。
日本語：こんにちは、世界。東京は今日晴れです。ラーメンを食べに行きましょう。
한국어: 안녕하세요, 세계! 오늘은 날씨가 좋습니다. 감사합니다.
العربية: مرحبا بالعالم، كيف حالك اليوم؟
हिन्दी: नमस्ते दुनिया, आप कैसे हैं?
עברית: שלום עולם, מה שלומך?
ไทย: สวัสดีชาวโลก ขอบคุณมาก
Emoji: 😀 😂 🚀 🔥 👍🏽 ❤️ 🎉 🤖 🐍 🍕 🌍 ✨ 👨‍👩‍👧‍👦 🇫🇷 — math: ∑ ∫ √ ≈ ≠ ∞ π ≤ ≥ → ← ✓ € £ ¥ © ®
"""

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ch", "sh", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "n", "r", "s", "l", "x")


def _syllables() -> list[str]:
    return ["".join(parts) for parts in itertools.product(_ONSETS, _VOWELS, _CODAS)]


def _filler_lines(num_words: int) -> list[str]:
    """Deterministic pseudo-words (two syllables each) so a large vocabulary has enough merges."""
    syllables = _syllables()
    words = ["".join(pair) for pair in itertools.islice(itertools.product(syllables, syllables[::7]), num_words)]
    return [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]


def corpus_lines(vocab_size: int) -> list[str]:
    """The training text for a vocabulary of `vocab_size`, repeated so common pieces merge first."""
    text = (ENGLISH + CODE + MULTILINGUAL).splitlines()
    return text * 3 + _filler_lines(max(0, vocab_size - 1024) * 2)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the demo byte-level BPE to exactly `vocab_size` tokens (special tokens first: ids 0, 1, 2)."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus_lines(vocab_size), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"demo corpus too small: BPE reached {tokenizer.get_vocab_size()} of {vocab_size} tokens")
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json for the demo tokenizer (ChatML template, no BOS added on encode)."""
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, tok in enumerate(SPECIAL_TOKENS)}
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def tokenizer_json(vocab_size: int) -> str:
    """The trained tokenizer serialized as tokenizer.json text (stable key order)."""
    return json.dumps(json.loads(train_tokenizer(vocab_size).to_str()), ensure_ascii=False, indent=2)
