import pytest

from gpufleet.server.shard import Shard, shard_of


def test_parse_reads_index_and_count_and_refuses_what_is_not_a_shard() -> None:
    assert Shard.parse("2/16") == Shard(2, 16)
    assert str(Shard.parse(" 0 / 1 ")) == "0/1"
    for bad in ("16/16", "-1/4", "2", "a/b", "1/0", ""):
        with pytest.raises(ValueError):
            Shard.parse(bad)


def test_every_job_has_exactly_one_owner_and_the_split_is_even() -> None:
    jobs = [f"job-{i}" for i in range(4000)]
    shards = [Shard(i, 8) for i in range(8)]
    owners = [[s.index for s in shards if s.owns_job(j)] for j in jobs]
    assert all(len(o) == 1 for o in owners)
    counts = [sum(1 for o in owners if o == [i]) for i in range(8)]
    assert min(counts) > 400 and max(counts) < 600


def test_the_hash_is_stable_across_processes() -> None:
    # A fixed value: a shard in another process (or another Python) must agree on it.
    assert shard_of("job-1", 16) == int.from_bytes(__import__("hashlib").sha256(b"job-1").digest()[:8], "big") % 16
    assert shard_of("llama-70b", 1) == 0


def test_a_job_decides_where_there_is_one_and_the_node_otherwise() -> None:
    shard = Shard(1, 2)
    job = next(f"j{i}" for i in range(100) if shard_of(f"j{i}", 2) == 0)
    node = next(f"n{i}" for i in range(100) if shard_of(f"n{i}", 2) == 1)
    assert not shard.owns(job, node)
    assert shard.owns(None, node)
    assert Shard().owns(job, node) and Shard().whole
