"""Regenerate tests/fixtures/gguf/quantized/: a tiny Llama quantized by llama.cpp's own tools (Q4_K_M, Q5_K_M, Q6_K, Q8_0).

CI cannot build llama.cpp, so the files it writes are committed (~1 MB each) and this script is how they
were made. It needs a llama.cpp source tree and its tools built:

    cmake -S LLAMA -B BUILD -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build BUILD --target llama-quantize -j2
    python experiments/llama_quantize_fixtures.py --llama-cpp LLAMA --build BUILD

The checkpoint is tests/gguf_models.py's tiny transformers Llama (hidden 256, intermediate 512, 2 layers,
tied head: every row a multiple of 256, so the K types apply everywhere) with the demo byte-level BPE
tokenizer, trained for a few seconds on a fixed rule (each token's successor is a permutation of the
vocabulary), so that its greedy choices have margins well above what quantizing activations moves: a
random model's logits are too flat for a greedy comparison to decide anything. llama.cpp's
convert_hf_to_gguf.py (with its own gguf-py, and `sentencepiece` installed, which it imports) writes it
as F32 and llama-quantize quantizes that. The converter names a BPE tokenizer by hashing its output on a test string, which only
known vocabularies pass: the demo tokenizer is declared "smollm" (SmolLM2's byte-level pre-tokenizer,
which it shares) instead; nothing else in the converter is changed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "gguf" / "quantized"
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
TRAIN_STEPS = 150              # the loss is below 0.05 after 100
CONVERT = """
import sys
sys.path.insert(0, {llama!r})
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", "f32", "--outfile", {out!r}]
convert_hf_to_gguf.main()
"""


def checkpoint(out: Path) -> Path:
    """The tiny transformers Llama with the demo tokenizer's files beside it."""
    from pdserve.engine.model.demo_corpus import tokenizer_config, tokenizer_json

    spec = importlib.util.spec_from_file_location("gguf_models", REPO / "tests" / "gguf_models.py")
    models = importlib.util.module_from_spec(spec)       # NOTE: not via sys.path: the repository's `kernels`
    spec.loader.exec_module(models)                      # would shadow the package transformers imports
    model = models.make_transformers_model("llama", tied=True, seed=7)
    train_to_a_rule(model, models.VOCAB)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(tokenizer_json(models.VOCAB))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    return out


def train_to_a_rule(model, vocab: int, seed: int = 0) -> None:
    """Teach `model` that token t is followed by rule[t] (a random permutation): sequences of 32 from random
    starts, Adam, TRAIN_STEPS steps of 16 sequences."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    rule = torch.randperm(vocab, generator=generator)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(TRAIN_STEPS):
        ids = [torch.randint(0, vocab, (16, 1), generator=generator)]
        for _ in range(31):
            ids.append(rule[ids[-1]])
        loss = model(torch.cat(ids, dim=1), labels=torch.cat(ids, dim=1)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    print(f"trained {TRAIN_STEPS} steps: loss {loss.item():.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree")
    parser.add_argument("--build", type=Path, required=True, help="its build folder (bin/llama-quantize)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = checkpoint(Path(tmp) / "hf")
        f32 = Path(tmp) / "tiny-f32.gguf"
        script = CONVERT.format(llama=str(args.llama_cpp), model=str(model), out=str(f32))
        subprocess.run([sys.executable, "-c", script], check=True)   # NOTE: with the tree's own gguf-py
        for kind in TYPES:
            subprocess.run([str(args.build / "bin" / "llama-quantize"), str(f32), str(OUT / f"tiny-{kind}.gguf"),
                            kind], check=True)
    for path in sorted(OUT.glob("*.gguf")):
        print(f"{path.relative_to(REPO)}: {path.stat().st_size / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
