"""vLLM's `--speculative-config`: the methods and fields pdserve implements, parsed and checked."""
from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.engine.core.suffix_proposer import SuffixParams

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 64
NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
METHOD_FIELDS = {"ngram": NGRAM_FIELDS, "suffix": SUFFIX_FIELDS, "draft_model": ("model",)}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` fields that pdserve implements (vLLM's defaults)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4              # suffix via from_json: suffix_decoding_max_tree_depth, as vLLM
    prompt_lookup_min: int = 5                   # vLLM's defaults when neither bound is given
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None     # None: the step cost model decides (engine.core.spec_policy)
    model: str | None = None                     # draft_model: the draft's checkpoint (as --model spells one)

    @classmethod
    def from_json(cls, text: str | dict | None) -> "SpeculativeConfig | None":
        """Parse vLLM's JSON spelling; None or '' means off. Raises ValueError naming what is wrong."""
        if not text:
            return None
        fields = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unsupported field(s) {unknown}; known: {sorted(known)}")
        defaults = {name: f.default for name, f in cls.__dataclass_fields__.items()}
        method = fields.get("method", defaults["method"])
        others = {name for m, names in METHOD_FIELDS.items() if m != method for name in names}
        foreign = sorted(set(fields) & others)
        if foreign:
            raise ValueError(f"--speculative-config: {foreign} do not apply to method {method!r}")
        if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
            fields["prompt_lookup_min"] = fields["prompt_lookup_max"]
        elif "prompt_lookup_min" in fields and "prompt_lookup_max" not in fields:
            fields["prompt_lookup_max"] = fields["prompt_lookup_min"]
        if method == "suffix" and "num_speculative_tokens" not in fields:
            fields["num_speculative_tokens"] = fields.get("suffix_decoding_max_tree_depth",
                                                          defaults["suffix_decoding_max_tree_depth"])
        config = cls(**fields)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method {self.method!r} is not supported (supported: {METHODS})")
        if not (isinstance(self.num_speculative_tokens, int)
                and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"--speculative-config: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("--speculative-config: disable_by_batch_size must be >= 1")
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError("--speculative-config: \"model\" (the draft's checkpoint) is required for method "
                             f"'draft_model' and applies to no other (method {self.method!r}, model {self.model!r})")
        self._validate_suffix()

    def _validate_suffix(self) -> None:
        if not 1 <= self.suffix_decoding_max_tree_depth <= 1024:
            raise ValueError("--speculative-config: suffix_decoding_max_tree_depth must be in [1, 1024]")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("--speculative-config: suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor < 0:
            raise ValueError("--speculative-config: suffix_decoding_max_spec_factor must be >= 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("--speculative-config: suffix_decoding_min_token_prob must be in [0, 1]")

    @property
    def suffix_params(self) -> SuffixParams:
        return SuffixParams(self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_spec_factor,
                            self.suffix_decoding_min_token_prob)
