"""Partitioners and row layout: pure decisions, checked against TF's documented results."""

from __future__ import annotations

import pytest
import torch

from paramserve.psserver.protocol.partition import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    RowRange,
    place_shards,
    split_rows,
)


class TestFixedShardsPartitioner:
    def test_caps_at_rows(self) -> None:
        partitioner = FixedShardsPartitioner(4)
        assert partitioner((10, 3), torch.float32) == [4, 1]
        assert partitioner((3, 3), torch.float32) == [3, 1]

    def test_scalar_and_empty_get_one_shard(self) -> None:
        partitioner = FixedShardsPartitioner(4)
        assert partitioner((), torch.float32) == [1]
        assert partitioner((0, 5), torch.float32) == [1, 1]

    @pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
    def test_rejects_bad_count(self, bad: object) -> None:
        with pytest.raises(ValueError, match="num_shards"):
            FixedShardsPartitioner(bad)  # type: ignore[arg-type]


class TestMinSizePartitioner:
    def test_tf_documented_examples(self) -> None:
        # From TF's MinSizePartitioner docstring and sharded_variable_test.
        assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32) == [2, 1]
        assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), torch.float32) == [6, 1]

    def test_small_variable_gets_one_shard(self) -> None:
        assert MinSizePartitioner(max_shards=8)((10, 10), torch.float32) == [1, 1]

    def test_rounds_up_like_tf(self) -> None:
        # 1024 x 1024 float32 = 4 MiB = 16 x 256 KiB (TF docstring example); 10 bytes / 3 rounds up to 4.
        assert MinSizePartitioner(max_shards=100)((1024, 1024), torch.float32) == [16, 1]
        assert MinSizePartitioner(min_shard_bytes=3, max_shards=100)((10,), torch.uint8) == [4]

    def test_capped_by_rows(self) -> None:
        assert MinSizePartitioner(min_shard_bytes=1, max_shards=100)((3, 1000), torch.float64) == [3, 1]

    def test_dtype_size_counts(self) -> None:
        shape = (1000, 64)
        wide, narrow = (
            MinSizePartitioner(64 << 10, 100)(shape, torch.float64),
            MinSizePartitioner(64 << 10, 100)(shape, torch.float32),
        )
        assert wide[0] == 2 * narrow[0]

    @pytest.mark.parametrize(
        "kwargs, name",
        [
            ({"min_shard_bytes": 0}, "min_shard_bytes"),
            ({"max_shards": 0}, "max_shards"),
            ({"bytes_per_string": -1}, "bytes_per_string"),
        ],
    )
    def test_rejects_bad_arguments(self, kwargs: dict, name: str) -> None:
        with pytest.raises(ValueError, match=name):
            MinSizePartitioner(**kwargs)


class TestMaxSizePartitioner:
    def test_tf_documented_examples(self) -> None:
        assert MaxSizePartitioner(max_shard_bytes=4)((6, 1), torch.float32) == [6, 1]
        assert MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), torch.float32) == [2, 1]
        assert MaxSizePartitioner(max_shard_bytes=1024)((6, 1), torch.float32) == [1, 1]

    def test_rows_per_shard_rounding(self) -> None:
        # 10 rows of 16 bytes; 40 bytes hold 2 rows -> 5 shards; 50 bytes hold 3 rows -> 4 shards.
        assert MaxSizePartitioner(40)((10, 4), torch.float32) == [5, 1]
        assert MaxSizePartitioner(50)((10, 4), torch.float32) == [4, 1]

    def test_row_larger_than_limit_gets_own_shard(self) -> None:
        assert MaxSizePartitioner(1)((7, 100), torch.float32) == [7, 1]

    def test_degenerate_shapes(self) -> None:
        assert MaxSizePartitioner(4)((), torch.float32) == [1]
        assert MaxSizePartitioner(4)((0, 3), torch.float32) == [1, 1]
        assert MaxSizePartitioner(4)((5, 0), torch.float32) == [1, 1]

    @pytest.mark.parametrize(
        "kwargs, name",
        [({"max_shard_bytes": 0}, "max_shard_bytes"), ({"max_shard_bytes": 8, "max_shards": 0}, "max_shards")],
    )
    def test_rejects_bad_arguments(self, kwargs: dict, name: str) -> None:
        with pytest.raises(ValueError, match=name):
            MaxSizePartitioner(**kwargs)


class TestSplitRows:
    def test_first_shards_get_the_extra_rows(self) -> None:
        assert split_rows(10, 3) == [RowRange(0, 4), RowRange(4, 7), RowRange(7, 10)]
        assert [len(r) for r in split_rows(11, 4)] == [3, 3, 3, 2]

    @pytest.mark.parametrize("rows, shards", [(1, 1), (7, 7), (100, 3), (5, 2), (0, 1)])
    def test_contiguous_cover(self, rows: int, shards: int) -> None:
        ranges = split_rows(rows, shards)
        assert len(ranges) == shards
        assert ranges[0].start == 0 and ranges[-1].stop == rows
        assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1

    def test_rejects_more_shards_than_rows(self) -> None:
        with pytest.raises(ValueError, match="at most 3"):
            split_rows(3, 4)

    def test_rejects_negative_rows(self) -> None:
        with pytest.raises(ValueError, match="num_rows"):
            split_rows(-1, 1)


class TestPlaceShards:
    def test_round_robin_from_first(self) -> None:
        assert place_shards(5, 3, 1) == [1, 2, 0, 1, 2]

    def test_first_server_wraps(self) -> None:
        assert place_shards(2, 3, 7) == [1, 2]
        assert place_shards(2, 3, -1) == [2, 0]

    def test_no_shards(self) -> None:
        assert place_shards(0, 3, 0) == []

    def test_rejects_no_servers(self) -> None:
        with pytest.raises(ValueError, match="num_servers"):
            place_shards(2, 0, 0)
