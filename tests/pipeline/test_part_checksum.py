"""Part files find damage anywhere in their pages, page headers included (page checksums alone cover page data:
a flipped byte in a header's statistics read back as if nothing happened)."""
from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.pipeline.output import BODY_CRC_KEY, SCHEMA, PartUnreadable, read_part, write_part


def random_rows(rng: random.Random, n: int) -> pa.Table:
    def value(ty: pa.DataType):
        if rng.random() < 0.1:
            return None
        if pa.types.is_string(ty):
            return "".join(rng.choice("abcxyz é") for _ in range(rng.randint(0, 30)))
        if pa.types.is_floating(ty):
            return rng.uniform(-10, 10)
        if pa.types.is_integer(ty):
            return rng.randint(0, 10_000)
        if pa.types.is_boolean(ty):
            return rng.random() < 0.5
        if pa.types.is_timestamp(ty):
            return rng.randint(1_700_000_000_000, 1_800_000_000_000)
        if pa.types.is_list(ty):
            return [value(ty.value_type) for _ in range(rng.randint(0, 5))]
        raise AssertionError(f"no random value for {ty}")
    rows = [{f.name: value(f.type) for f in SCHEMA} for _ in range(n)]
    for i, r in enumerate(rows):
        r["row_id"] = f"row-{i}"
    return pa.Table.from_pylist(rows, schema=SCHEMA).replace_schema_metadata({b"batchjob": b"{}"})


def footer_start(blob: bytes) -> int:
    return len(blob) - 8 - int.from_bytes(blob[-8:-4], "little")


def test_every_damaged_page_byte_is_found(tmp_path, rng):
    table = random_rows(rng, rng.randint(3, 40))
    part = tmp_path / "part-00000.parquet"
    write_part(part, table)
    assert read_part(part).equals(table.cast(SCHEMA)), "an undamaged part reads back as written"
    blob = part.read_bytes()
    end = footer_start(blob)
    positions = rng.sample(range(end), min(end, 400))
    missed = []
    for pos in positions:
        damaged = bytearray(blob)
        damaged[pos] ^= rng.randint(1, 255)
        part.write_bytes(bytes(damaged))
        try:
            read_part(part)
            missed.append(pos)
        except PartUnreadable as err:
            assert err.damaged.path == part and err.damaged.reason
    assert not missed, f"damaged bytes read back as data at offsets {missed[:10]} of {end} page bytes"


def test_runs_of_garbled_bytes_are_found(tmp_path, rng):
    part = tmp_path / "part-00001.parquet"
    write_part(part, random_rows(rng, 20))
    blob = part.read_bytes()
    end = footer_start(blob)
    for _ in range(200):
        damaged = bytearray(blob)
        start = rng.randint(0, end - 2)
        for i in range(start, min(end, start + rng.randint(2, 64))):
            damaged[i] ^= rng.randint(1, 255)
        part.write_bytes(bytes(damaged))
        with pytest.raises(PartUnreadable):
            read_part(part)


def test_rewriting_a_part_replaces_its_crc(tmp_path, rng):
    """rewrite_parts hands write_part the old part's metadata, CRC included: the new part must carry its own."""
    part = tmp_path / "part-00002.parquet"
    write_part(part, random_rows(rng, 5))
    old = pq.read_schema(part).metadata
    write_part(part, random_rows(rng, 7).replace_schema_metadata(old))
    assert pq.read_schema(part).metadata[BODY_CRC_KEY] != old[BODY_CRC_KEY]
    assert read_part(part).num_rows == 7


def test_parts_written_before_the_crc_still_read(tmp_path, rng):
    table = random_rows(rng, 6)
    part = tmp_path / "part-00003.parquet"
    pq.write_table(table, part, write_page_checksum=True)
    assert read_part(part).equals(table.cast(SCHEMA))


def test_a_part_re_encoded_by_another_writer_is_not_called_damaged(tmp_path, rng):
    """pyarrow copies the schema's metadata, our CRC included, into a file it re-encodes (a user editing rows):
    its pages have another length, and the stale CRC must not turn the edit into damage."""
    part = tmp_path / "part-00004.parquet"
    write_part(part, random_rows(rng, 8))
    edited = pq.read_table(part).to_pylist()
    edited[rng.randrange(len(edited))]["error"] = "edited by hand " + "x" * rng.randint(1, 40)
    table = pa.Table.from_pylist(edited, schema=pq.read_schema(part))
    assert BODY_CRC_KEY in table.schema.metadata
    pq.write_table(table, part)
    assert read_part(part).to_pylist() == pa.Table.from_pylist(edited, schema=SCHEMA).to_pylist()


def test_a_damaged_crc_value_is_damage(tmp_path, rng):
    part = tmp_path / "part-00005.parquet"
    write_part(part, random_rows(rng, 4))
    blob = bytearray(part.read_bytes())
    value = pq.read_schema(part).metadata[BODY_CRC_KEY]
    at = blob.rindex(value)
    blob[at + len(value) - 1: at + len(value)] = b"z"      # the length's last digit, in the footer
    part.write_bytes(bytes(blob))
    with pytest.raises(PartUnreadable):
        read_part(part)


def test_a_column_renamed_by_footer_damage_is_damage(tmp_path, rng):
    """The footer has no checksum: a flipped byte in a column's name read that column back as nulls (as if an
    older part lacked it). Each place the name is spelt in the footer, damaged in turn: the part is refused, or
    it reads back exactly as written."""
    table = random_rows(rng, rng.randint(3, 20))
    part = tmp_path / "part-00006.parquet"
    write_part(part, table)
    blob = part.read_bytes()
    name = rng.choice([n for n in SCHEMA.names if len(n) > 3]).encode()
    spots = [i for i in range(footer_start(blob), len(blob)) if blob.startswith(name, i)]
    assert spots, name
    refused = 0
    for at in spots:
        damaged = bytearray(blob)
        damaged[at + 1] ^= 0x20 if chr(damaged[at + 1]).isalpha() else 0x01       # 'run_id' -> 'rUn_id'
        part.write_bytes(bytes(damaged))
        try:
            got = read_part(part)
        except PartUnreadable as err:
            refused += 1
            assert err.damaged.path == part and err.damaged.reason
            continue
        assert got.equals(table.cast(SCHEMA)), (name, at, "a renamed column read back as data")
    assert refused, f"no spelling of {name!r} in the footer named the column"
