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


def test_every_damaged_page_byte_is_found(tmp_path, rng=random.Random()):
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


def test_runs_of_garbled_bytes_are_found(tmp_path, rng=random.Random()):
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


def test_rewriting_a_part_replaces_its_crc(tmp_path, rng=random.Random()):
    """rewrite_parts hands write_part the old part's metadata, CRC included: the new part must carry its own."""
    part = tmp_path / "part-00002.parquet"
    write_part(part, random_rows(rng, 5))
    old = pq.read_schema(part).metadata
    write_part(part, random_rows(rng, 7).replace_schema_metadata(old))
    assert pq.read_schema(part).metadata[BODY_CRC_KEY] != old[BODY_CRC_KEY]
    assert read_part(part).num_rows == 7


def test_parts_written_before_the_crc_still_read(tmp_path, rng=random.Random()):
    table = random_rows(rng, 6)
    part = tmp_path / "part-00003.parquet"
    pq.write_table(table, part, write_page_checksum=True)
    assert read_part(part).equals(table.cast(SCHEMA))
