"""Eval metrics over images: CLIP score and aesthetic by the score stage's ViT-L/14 and head;
memorisation as each generation's nearest training image by that same embedding, exact and
blockwise (all generations against one training shard at a time: memory holds a shard, the cost
is linear in the training set). Sources not scored with the eval's scorer are embedded once per
shard from their images: `<source>/embeddings/<scorer name>/NNNNN.parquet` (key, fp16 embedding;
a folder per scorer, a file per fetched shard), keyed in its footer (`MADE_FROM`) by the scorer's
identity and the shard's fetch record, as score's records are: other weights or a refetch make it
again.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from PIL import Image

from sdtrain.atomic import atomic_path
from tasks.curation.score import Scorer, read_images, shard_done
from tasks.runtime.shards import stats_path

EMBEDDINGS = "embeddings"
MADE_FROM = b"sdpipe.made_from"  # an embeddings file's key, in its parquet footer


def clip_score(cosine: np.ndarray) -> np.ndarray:
    """CLIP score as torchmetrics (and Mosaic's diffusion) define it: 100 x max(cos, 0)."""
    return 100 * np.clip(cosine, 0, None)


@dataclass(frozen=True, slots=True)
class ImageScores:
    cosine: np.ndarray  # float64 [N]: image-prompt cosine
    aesthetic: np.ndarray  # float64 [N]
    embedding: np.ndarray  # float32 [N, D], L2-normalized

    @classmethod
    def concat(cls, parts: Sequence[ImageScores]) -> ImageScores:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls.__slots__))


@torch.no_grad()
def embed_images(scorer: Scorer, images: Sequence[Image.Image]) -> torch.Tensor:
    """L2-normalized embeddings [N, D] (float32, on the scorer's device), as the score stage."""
    dev = scorer.device
    pixels = torch.stack([scorer.embed_tf(im.convert("RGB")) for im in images]).to(dev)
    with torch.autocast(dev.type, dtype=torch.float16, enabled=dev.type == "cuda"):
        emb = scorer.embed.encode_image(pixels)
    return F.normalize(emb.float(), dim=-1)


@torch.no_grad()
def score_images(
    scorer: Scorer, images: Sequence[Image.Image], prompts: Sequence[str], batch_size: int = 32
) -> ImageScores:
    """Image-prompt cosine and LAION aesthetic of each image, `batch_size` at a time."""
    dev = scorer.device
    cosine, aesthetic, embedding = [], [], []
    for start in range(0, len(images), batch_size):
        image_emb = embed_images(scorer, images[start : start + batch_size])
        tokens = scorer.tokenizer(list(prompts[start : start + batch_size])).to(dev)
        with torch.autocast(dev.type, dtype=torch.float16, enabled=dev.type == "cuda"):
            text_emb = scorer.embed.encode_text(tokens)
        text_emb = F.normalize(text_emb.float(), dim=-1)
        cosine.append((image_emb * text_emb).sum(-1).double().cpu().numpy())
        aesthetic.append(scorer.aesthetic(image_emb).double().cpu().numpy())
        embedding.append(image_emb.cpu().numpy())
    dim = scorer.embed.visual.output_dim
    return ImageScores(
        cosine=np.concatenate(cosine) if cosine else np.zeros(0),
        aesthetic=np.concatenate(aesthetic) if aesthetic else np.zeros(0),
        embedding=np.concatenate(embedding) if embedding else np.zeros((0, dim), np.float32),
    )


# ---- the training images ------------------------------------------------------------------------


def read_shard_images(root: Path, source: str, shard: str, keys: set[str]) -> dict:
    """key -> image (RGB) of `keys` in a source's fetched shard."""
    data = read_images(root / source / "shards" / f"{shard}.tar", keys)
    return {k: Image.open(io.BytesIO(v)).convert("RGB") for k, v in data.items()}


def made_from(root: Path, source: str, shard: str, scorer: Scorer) -> dict:
    """What a shard's embeddings are made from: the scorer (its `score.scorer_identity`: name,
    settings, weights files' digests) and the shard's fetch record (its digest; a refetch
    rewrites it; "" where the shard has none)."""
    record = stats_path(root, source, "shards", shard)
    # Hashed each time (a few hundred bytes), not through the weights' per-process digest cache,
    # which would keep an entry per shard ever read.
    digest = hashlib.sha256(record.read_bytes()).hexdigest()[:16] if record.is_file() else ""
    return {"scorer_identity": scorer.identity, "shard_record": digest}


def embedded_shard(
    root: Path, source: str, shard: str, scorer: Scorer, scorer_name: str, *, batch_size: int = 64
) -> Path:
    """`<source>/embeddings/<scorer>/<shard>.parquet` (key, fp16 embedding) of every fetched
    image of the shard, written (atomically) once per `made_from` and reused by every later
    eval; a file made from another scorer or fetch is made again."""
    out = root / source / EMBEDDINGS / scorer_name / f"{shard}.parquet"
    key = made_from(root, source, shard, scorer)
    if out.is_file() and (pq.read_schema(out).metadata or {}).get(MADE_FROM) == _encoded(key):
        return out
    table = pq.read_table(root / source / "shards" / f"{shard}.parquet", columns=["key", "status"])
    keys = [k for k, s in zip(*table.to_pydict().values(), strict=True) if s == "success"]
    data = read_images(root / source / "shards" / f"{shard}.tar", set(keys))
    keys = [k for k in keys if k in data]
    parts = []
    for start in range(0, len(keys), batch_size):
        images = [Image.open(io.BytesIO(data[k])) for k in keys[start : start + batch_size]]
        parts.append(embed_images(scorer, images).half().cpu().numpy())
    dim = scorer.embed.visual.output_dim
    emb = np.concatenate(parts) if parts else np.zeros((0, dim), np.float16)
    written = pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), dim),
        }
    ).replace_schema_metadata({MADE_FROM: _encoded(key)})
    with atomic_path(out) as tmp:
        pq.write_table(written, tmp)
    return out


def _encoded(key: dict) -> bytes:
    return json.dumps(key, sort_keys=True).encode()


def _read_embeddings(
    path: Path, keys: Sequence[str] | pa.Array
) -> tuple[list[str], np.ndarray] | None:
    """(keys, fp16 [n, D]) of `keys` in a scores/embeddings parquet; None if one is missing."""
    table = pq.read_table(path, columns=["key", "embedding"])
    wanted = keys if isinstance(keys, pa.Array) else pa.array(list(keys), pa.string())
    table = table.filter(pc.is_in(table["key"], wanted))
    if table.num_rows < pc.count_distinct(wanted).as_py():
        return None
    column = table["embedding"].combine_chunks()
    emb = column.flatten().to_numpy(zero_copy_only=False).reshape(table.num_rows, -1)
    return table["key"].to_pylist(), emb.astype(np.float16)


@dataclass(frozen=True, slots=True)
class Block:
    source: str
    shard: str
    keys: list[str]
    embedding: np.ndarray  # fp16 [n, D]
    computed: bool  # embedded here (the source was not scored with the eval's scorer)


def training_blocks(
    root: Path,
    rows: dict[tuple[str, str], Sequence[str] | pa.Array],
    scorer: Scorer,
    scorer_name: str,
    scored_with: dict[str, str],
) -> Iterator[Block]:
    """The embeddings of the training keys, one (source, shard) at a time. `scored_with`: the
    scoring model each source's score stage used ("" for none); a shard's scores are read only
    where they are done by this very scorer (`score.shard_done`: its weights, this fetch)."""
    for (source, shard), keys in sorted(rows.items()):
        found = None
        scores = root / source / "scores" / f"{shard}.parquet"
        if scored_with.get(source) == scorer_name and shard_done(
            root, source, shard, scorer.identity
        ):
            found = _read_embeddings(scores, keys)
        computed = found is None
        if computed:
            found = _read_embeddings(embedded_shard(root, source, shard, scorer, scorer_name), keys)
            if found is None:
                raise FileNotFoundError(
                    f"{root / source / 'shards' / shard}.tar lacks images of training rows"
                )
        yield Block(source, shard, found[0], found[1], computed)


class Counted:
    """Blocks passed through, counting the training rows and the sources embedded here."""

    def __init__(self, blocks: Iterator[Block]):
        self.blocks, self.num_rows, self.embedded_here = blocks, 0, set()

    def __iter__(self) -> Iterator[Block]:
        for block in self.blocks:
            self.num_rows += len(block.keys)
            if block.computed:
                self.embedded_here.add(block.source)
            yield block


@dataclass(frozen=True, slots=True)
class Nearest:
    similarity: np.ndarray  # float64 [G]: cosine to the nearest training image
    source: list[str | None]
    shard: list[str | None]
    key: list[str | None]


def nearest_training(
    generated: np.ndarray, blocks: Iterable[Block], device, query_rows: int = 4096
) -> Nearest:
    """Each generation's nearest training image (cosine of unit embeddings), block by block,
    `query_rows` generations at a time (a similarity matrix of at most that x a shard)."""
    return nearest_training_many([generated], blocks, device, query_rows)[0]


@torch.no_grad()
def nearest_training_many(
    generated: Sequence[np.ndarray], blocks: Iterable[Block], device, query_rows: int = 4096
) -> list[Nearest]:
    """`nearest_training` of several candidates' generations in one pass over the training
    blocks: each block is read once and compared with every candidate's generations, each
    candidate's exactly as a scan of its own would (the same splits, the same numbers). Memory
    holds one block and all candidates' embeddings."""
    gens = [
        F.normalize(torch.from_numpy(np.asarray(g, np.float32)).to(device), dim=1)
        for g in generated
    ]
    best = [np.full(len(g), -np.inf) for g in gens]
    source: list[list[str | None]] = [[None] * len(g) for g in gens]
    shard: list[list[str | None]] = [[None] * len(g) for g in gens]
    key: list[list[str | None]] = [[None] * len(g) for g in gens]
    for block in blocks:
        if not block.keys:
            continue
        train = F.normalize(torch.from_numpy(block.embedding).to(device).float(), dim=1)
        for c, gen in enumerate(gens):
            if not len(gen):
                continue
            found = [(q @ train.T).max(dim=1) for q in gen.split(query_rows)]
            sims = torch.cat([f.values for f in found]).double().cpu().numpy()
            where = torch.cat([f.indices for f in found]).cpu().numpy()
            for g in np.flatnonzero(sims > best[c]):
                best[c][g] = sims[g]
                source[c][g], shard[c][g] = block.source, block.shard
                key[c][g] = block.keys[where[g]]
    return [Nearest(*parts) for parts in zip(best, source, shard, key, strict=True)]
