"""The DJL byte formats of DESIGN §2: batch_NNN keys, binary_encode, Output.add keys."""
import struct

from lmi_handler.djl import OwnInput, OwnOutput, PairList, binary_decode


def test_binary_encode_packs_count_then_length_prefixed_utf8_pairs():
    raw = OwnOutput.binary_encode({"data": "é", "last": "true"})
    assert raw[:2] == struct.pack(">h", 2)
    assert raw[2:6] == struct.pack(">i", 4) and raw[6:10] == b"data"
    assert raw[10:14] == struct.pack(">i", 2) and raw[14:16] == "é".encode()
    assert binary_decode(raw) == {"data": "é", "last": "true"}


def test_binary_decode_round_trips_emoji_and_empty_values():
    entry = {"data": "", "last": "false", "content_type": "application/jsonlines", "request_id": "😀-1"}
    assert binary_decode(OwnOutput.binary_encode(entry)) == entry


def test_get_batches_splits_properties_and_content_by_index():
    props = {"batch_size": "3", "batch_000.requestId": "a", "batch_002.Content-Type": "application/json"}
    content = PairList([("batch_000.data", b""), ("batch_001.data", b"x"), ("batch_002.data", b'{"inputs":"hi"}'),
                        ("batch_002.seed", b"-17")])
    items = OwnInput(props, content).get_batches()
    assert len(items) == 3
    assert items[0].get_property("requestId") == "a"
    assert items[2].get_property("content-type") == "application/json"  # case-insensitive lookup
    assert items[1].get_as_bytes("data") == b"x"
    assert items[2].get_as_json("data") == {"inputs": "hi"}
    assert items[2].get_as_string("seed") == "-17"


def test_unbatched_input_is_its_own_single_batch():
    single = OwnInput({"Content-Type": "application/json"}, PairList([("data", b"{}")]))
    assert single.get_batches() == [single]
    assert not single.is_empty()
    assert OwnInput({"model_id": "m"}).is_empty()


def test_output_add_prefixes_key_with_unpadded_batch_index_and_error_body():
    out = OwnOutput()
    out.add(b"abc", key="data", batch_index=7)
    assert out.content.key_at(0) == "batch_7.data"
    out.add_as_json({"generated_text": "ü"}, batch_index=1)
    assert out.content.value_at(1) == '{"generated_text": "ü"}'.encode()
    err = OwnOutput().error("boom")
    assert err.code == 424
    assert err.content.value_at(0) == b'{"code": 424, "message": "prediction failure", "error": "boom"}'
