"""The one-pass metadata reader against the gguf package's own reader: the same keys, values, value types and
tensors, for every value type, arrays of arrays and big-endian files; broken files are errors that name them."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pdserve.engine.model.gguf_reader import GGUFError, GGUFFile, GGUFMetadataReader
from pdserve.engine.model.resolve import smollm2_gguf


def written(path, endianess=gguf.GGUFEndian.LITTLE, nested=False):
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_uint8("t.u8", 200), writer.add_int8("t.i8", -5), writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -300), writer.add_uint32("t.u32", 4_000_000_000), writer.add_int32("t.i32", -7)
    writer.add_float32("t.f32", 0.1), writer.add_uint64("t.u64", 2**63 + 5), writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1e-300), writer.add_bool("t.bool", True), writer.add_string("t.str", "héllo")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "ü" * 300])
    writer.add_array("t.ints", [1, -2, 3]), writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.bools", [True, False]), writer.add_array("t.none", [])
    if nested:
        writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_uint32("t.after", 9)
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("v", np.ones(5, dtype=np.float16))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same(path):
    theirs, ours = gguf.GGUFReader(path), GGUFMetadataReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types, key
        assert mine.contents() == field.contents(), key
        assert repr(mine.contents()) == repr(field.contents()), key        # int stays int, float float
    assert [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in ours.tensors] == \
           [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(mine.data, tensor.data)


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
@pytest.mark.parametrize("nested", [False, True])
def test_every_value_type_reads_as_the_package_reads_it(tmp_path, endianess, nested):
    assert_same(written(tmp_path / "m.gguf", endianess, nested))


def test_the_default_model_reads_as_the_package_reads_it():
    assert_same(smollm2_gguf())


def test_a_truncated_file_or_a_bad_string_is_an_error_naming_the_file_or_key(tmp_path):
    path = written(tmp_path / "m.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:data.index(b"t.strings") + 40])
    with pytest.raises(GGUFError, match="cut.gguf"):
        GGUFFile(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data.replace("héllo".encode(), b"h\xff\xffllo"))
    with pytest.raises(GGUFError, match="t.str"):
        GGUFFile(bad).value("t.str")
