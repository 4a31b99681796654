"""Stage runtime: the shard contract (records, resumability), concurrency, loopback, pictures."""
