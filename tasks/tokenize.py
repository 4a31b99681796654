"""tokenize: the kept captions of a shard -> SD1 CLIP ids, `tokens/NNNNN.parquet`.

77 ids per caption (BOS 49406, caption, EOS 49407, padded with 49407, truncated at 77), stored
as a fixed-size int32 list so readers get a [N, 77] array without parsing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdtrain.models import MAX_TOKENS, tokenize
from tasks.shards import ShardStats, atomic_path, run_shard

STAGE = "tokens"


def tokens_table(keys: list[str], captions: list[str]) -> pa.Table:
    ids = (
        tokenize(captions).numpy().astype(np.int32)
        if captions
        else np.zeros((0, MAX_TOKENS), np.int32)
    )
    flat = pa.array(ids.reshape(-1), pa.int32())
    return pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "input_ids": pa.FixedSizeListArray.from_arrays(flat, MAX_TOKENS),
        }
    )


def tokenize_shard(root: Path, source: str, shard: str) -> ShardStats:
    selected = root / source / "selected" / f"{shard}.parquet"

    def work(stats: ShardStats) -> None:
        table = pq.read_table(selected)
        stats.num_in = table.num_rows
        keys, captions = [], []
        for key, caption in zip(
            table["key"].to_pylist(), table["caption"].to_pylist(), strict=True
        ):
            if caption is None or not caption.strip():
                stats.drop("empty_caption")
                continue
            keys.append(key)
            captions.append(caption.strip())
        out = tokens_table(keys, captions)
        with atomic_path(root / source / STAGE / f"{shard}.parquet") as tmp:
            pq.write_table(out, tmp)
        stats.num_out = out.num_rows

    return run_shard(root, source, STAGE, shard, work)
