"""The score stage: LAION's published heads load as published, weights come from the catalog's
paths (or a one-line error says which file is missing and where to get it), and a shard's
decodable images each get scores, a pHash and an embedding."""

from __future__ import annotations

import dataclasses
import io
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from catalog.schema import ScoringModel
from tasks.curation import score
from tasks.sources import demo_source


@pytest.fixture(scope="module")
def tiny() -> ScoringModel:
    return load_catalog(PACKAGED_DIR).scorer("tiny-scoring")


def published_spec(**weights: str) -> ScoringModel:
    return ScoringModel(name="published", kind="scoring", **weights)


def save(state: dict, path: Path) -> str:
    torch.save(state, path)
    return str(path)


def test_aesthetic_head_loads_the_published_state_dict(tmp_path):
    # sac+logos+ava1-l14-linearMSE.pth: five linear layers at layers.{0,2,4,6,7}, no activations.
    shapes = {0: (1024, 768), 2: (128, 1024), 4: (64, 128), 6: (16, 64), 7: (1, 16)}
    g = torch.Generator().manual_seed(0)
    state = {}
    for i, (out_dim, in_dim) in shapes.items():
        state[f"layers.{i}.weight"] = torch.randn(out_dim, in_dim, generator=g) / in_dim**0.5
        state[f"layers.{i}.bias"] = torch.randn(out_dim, generator=g)
    spec = published_spec(aesthetic_weights=save(state, tmp_path / "aesthetic.pth"))
    head = score.AestheticHead(768)
    score.load_weights(head, spec, "aesthetic")
    head.eval()
    x = F.normalize(torch.randn(3, 768, generator=g), dim=-1)
    expected = x
    for i in shapes:
        expected = expected @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(head(x), expected.squeeze(-1))


def test_nsfw_head_loads_the_published_state_dict(tmp_path):
    # clip_ViT-L-14_openai_binary_nsfw_head.pth: Keras normalization + 768-64-512-256-1, ReLU.
    g = torch.Generator().manual_seed(0)
    dims = [768, 64, 512, 256, 1]
    state = {"norm.mean": torch.randn(768, generator=g), "norm.variance": torch.rand(768) + 0.5}
    for i in range(4):
        state[f"linear_{i + 1}.weight"] = torch.randn(dims[i + 1], dims[i], generator=g) * 0.05
        state[f"linear_{i + 1}.bias"] = torch.randn(dims[i + 1], generator=g) * 0.05
    spec = published_spec(nsfw_weights=save(state, tmp_path / "nsfw.pth"))
    head = score.NSFWHead(768)
    score.load_weights(head, spec, "nsfw")
    x = F.normalize(torch.randn(3, 768, generator=g), dim=-1)
    h = (x - state["norm.mean"]) / state["norm.variance"].sqrt()
    for i in range(1, 5):
        h = h @ state[f"linear_{i}.weight"].T + state[f"linear_{i}.bias"]
        h = torch.relu(h) if i < 4 else torch.sigmoid(h)
    torch.testing.assert_close(head(x), h.squeeze(-1), rtol=1e-4, atol=1e-5)


def test_watermark_classifier_loads_the_published_state_dict(tmp_path):
    # watermark_model_v1.pt: timm efficientnet_b3(a) body + classifier.{0,3,5}, softmax index 0.
    import timm

    body = timm.create_model("efficientnet_b3", pretrained=False, num_classes=2).state_dict()
    state = {k: v for k, v in body.items() if not k.startswith("classifier.")}
    head_shapes = {0: (625, 1536), 3: (256, 625), 5: (2, 256)}
    for i, shape in head_shapes.items():
        state[f"classifier.{i}.weight"] = torch.zeros(shape)
        state[f"classifier.{i}.bias"] = torch.zeros(shape[0])
    state["classifier.5.bias"] = torch.tensor([4.0, 0.0])  # every image "watermarked"
    spec = published_spec(watermark_weights=save(state, tmp_path / "wm.pt"))
    model = score.watermark_classifier("efficientnet_b3")
    score.load_weights(model, spec, "watermark")
    model.eval()
    with torch.no_grad():
        probs = F.softmax(model(torch.randn(2, 3, 256, 256)), dim=1)
    pwatermark = probs[:, 0]  # index 0 is the watermark class
    torch.testing.assert_close(pwatermark, torch.full((2,), 1 / (1 + np.exp(-4.0))))


def test_missing_weights_name_every_file_and_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SDPIPE_WEIGHTS", str(tmp_path))
    spec = load_catalog(PACKAGED_DIR).scorer("laion-scoring")
    (tmp_path / spec.aesthetic_weights).parent.mkdir(parents=True)
    torch.save({}, tmp_path / spec.aesthetic_weights)  # one present: not listed
    with pytest.raises(score.ScoringWeightsError) as info:
        score.Scorer(spec, torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message
    for role in ("embed", "similarity", "nsfw", "watermark"):
        assert str(tmp_path / getattr(spec, f"{role}_weights")) in message
    assert "aesthetic_weights" not in message
    assert "watermark_model_v1.pt" in message and "huggingface.co" in message


def test_a_file_that_is_not_the_head_says_so(tmp_path):
    spec = published_spec(aesthetic_weights=save({"w": torch.zeros(1)}, tmp_path / "x"))
    with pytest.raises(score.ScoringWeightsError, match="not the aesthetic model's weights"):
        score.load_weights(score.AestheticHead(768), spec, "aesthetic")


def test_tiny_twins_are_tiny(tiny):
    scorer = score.load_scorer(tiny, torch.device("cpu"))
    nets = (scorer.embed, scorer.similarity, scorer.aesthetic, scorer.nsfw, scorer.watermark)
    num_params = sum(p.numel() for net in nets for p in net.parameters())
    assert num_params < 6_000_000  # mostly the two 49408-token embedding tables


def test_weights_load_from_the_catalog_paths(tiny, tmp_path):
    # A twin saved to files and loaded through *_weights gives the same scores as the twin.
    source = score.load_scorer(tiny, torch.device("cpu"))
    files = {
        "embed_weights": save(source.embed.state_dict(), tmp_path / "embed.bin"),
        "similarity_weights": save(source.similarity.state_dict(), tmp_path / "sim.bin"),
        "aesthetic_weights": save(source.aesthetic.state_dict(), tmp_path / "aes.pth"),
        "nsfw_weights": save(source.nsfw.state_dict(), tmp_path / "nsfw.pth"),
        "watermark_weights": save(source.watermark.state_dict(), tmp_path / "wm.pt"),
    }
    loaded = score.Scorer(
        dataclasses.replace(tiny, name="from-files", random_weights=False, **files),
        torch.device("cpu"),
        seed=123,  # different random init: only the files can make the scores match
    )
    images = [jpeg(i, 48) for i in range(3)]
    captions = ["a red circle", "a blue square", ""]
    kw = dict(batch_size=2, workers=1)
    _, expected, _ = score.score_images(source, images, captions, **kw)
    _, got, _ = score.score_images(loaded, images, captions, **kw)
    for name in ("aesthetic", "similarity", "pwatermark", "punsafe", "phash"):
        np.testing.assert_allclose(getattr(got, name), getattr(expected, name), rtol=1e-5)


def jpeg(seed: int, side: int) -> bytes:
    img, _ = demo_source.draw_scene(np.random.default_rng(seed), side, side)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_shard(root: Path, source: str, members: dict[str, bytes], rows: list[dict]) -> None:
    shards = root / source / "shards"
    shards.mkdir(parents=True)
    with tarfile.open(shards / "00000.tar", "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    pq.write_table(pa.Table.from_pylist(rows), shards / "00000.parquet")


def test_score_shard_scores_every_decodable_image(tiny, tmp_path):
    keys = [f"k{i}" for i in range(5)]
    members = {f"{k}.jpg": jpeg(i, 64) for i, k in enumerate(keys)}
    members["broken.jpg"] = b"<html>not an image</html>"
    rows = [{"key": k, "caption": f"scene {k}", "status": "success"} for k in keys]
    rows += [
        {"key": "broken", "caption": "x", "status": "success"},
        {"key": "gone", "caption": "x", "status": "success"},  # listed, not in the tar
        {"key": "failed", "caption": "x", "status": "http_404"},  # not fetched: not scored
    ]
    write_shard(tmp_path, "src", members, rows)
    stats = score.score_shard(tmp_path, "src", "00000", tiny, device="cpu")
    assert (stats.num_in, stats.num_out) == (7, 5)
    assert stats.dropped == {"decode_error": 1, "missing_image": 1}
    table = pq.read_table(tmp_path / "src" / "scores" / "00000.parquet")
    assert table["key"].to_pylist() == keys
    assert table.schema.field("phash").type == pa.uint64()
    assert table.schema.field("embedding").type == pa.list_(pa.float16(), 32)
    for column, (low, high) in {
        "pwatermark": (0, 1),
        "punsafe": (0, 1),
        "similarity": (-1, 1),
    }.items():
        values = table[column].to_numpy()
        assert ((values >= low) & (values <= high)).all(), column
    embeddings = np.stack(table["embedding"].to_numpy(zero_copy_only=False)).astype(np.float32)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1, atol=2e-3)
    again = score.score_shard(tmp_path, "src", "00000", tiny, device="cpu")
    assert again.skipped


def test_phash_is_stable_under_reencoding_and_resizing():
    original = Image.open(io.BytesIO(jpeg(7, 256)))
    small = original.resize((128, 128), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    small.save(buf, format="JPEG", quality=60)
    copy = Image.open(io.BytesIO(buf.getvalue()))
    other = Image.open(io.BytesIO(jpeg(8, 256)))
    h = score.phash(original)
    assert bin(h ^ score.phash(copy)).count("1") <= 4
    assert bin(h ^ score.phash(other)).count("1") > 10


def test_score_shard_follows_the_sample_table_not_the_tar(tiny, tmp_path):
    # Images are read from the tar as the decoders reach them, in sample-table order, whatever
    # order the tar holds them in; a key's last image member is its image.
    keys = [f"k{i}" for i in range(7)]
    images = {k: jpeg(i, 48) for i, k in enumerate(keys)}
    members = {f"{k}.jpg": images[k] for k in reversed(keys)}
    members["k2.png"] = images["k2"] = jpeg(99, 40)  # after k2.jpg in the tar
    rows = [{"key": k, "caption": f"scene {k}", "status": "success"} for k in keys]
    write_shard(tmp_path, "src", members, rows)
    score.score_shard(tmp_path, "src", "00000", tiny, device="cpu", batch_size=3, workers=2)
    table = pq.read_table(tmp_path / "src" / "scores" / "00000.parquet")
    assert table["key"].to_pylist() == keys
    scorer = score.load_scorer(tiny, torch.device("cpu"))
    _, expected, _ = score.score_images(
        scorer, [images[k] for k in keys], [r["caption"] for r in rows], batch_size=3, workers=1
    )
    np.testing.assert_array_equal(table["aesthetic"].to_numpy(), expected.aesthetic)
    np.testing.assert_array_equal(table["phash"].to_numpy(), expected.phash)


def test_a_shard_scored_by_other_weights_under_the_same_name_is_scored_again(tiny, tmp_path):
    """Issue 26: the score stage is keyed by the scorer's identity (name, settings, weights
    files' digests), as encode by its latent spec: new weights under the same name score again
    (scores, pHashes, embeddings), the same weights skip; weights are hashed once per process."""
    from tasks.curation import score_nets

    twin = score.load_scorer(tiny, torch.device("cpu"))
    files = {
        "embed_weights": save(twin.embed.state_dict(), tmp_path / "embed.bin"),
        "similarity_weights": save(twin.similarity.state_dict(), tmp_path / "sim.bin"),
        "aesthetic_weights": save(twin.aesthetic.state_dict(), tmp_path / "aes.pth"),
        "nsfw_weights": save(twin.nsfw.state_dict(), tmp_path / "nsfw.pth"),
        "watermark_weights": save(twin.watermark.state_dict(), tmp_path / "wm.pt"),
    }
    spec = dataclasses.replace(tiny, name="mine", random_weights=False, **files)
    keys = [f"k{i}" for i in range(4)]
    rows = [{"key": k, "caption": f"scene {k}", "status": "success"} for k in keys]
    root = tmp_path / "root"
    write_shard(root, "src", {f"{k}.jpg": jpeg(i, 48) for i, k in enumerate(keys)}, rows)
    out = root / "src" / "scores" / "00000.parquet"

    score_nets._digests.clear()
    first = score.score_shard(root, "src", "00000", spec, device="cpu")
    before = pq.read_table(out)["aesthetic"].to_numpy()
    identity = score.scorer_identity(spec)
    assert first.extra["scorer_identity"] == identity and identity["model"] == "mine"
    assert set(identity["weights"]) == {"embed", "similarity", "aesthetic", "nsfw", "watermark"}
    assert score.score_shard(root, "src", "00000", spec, device="cpu").skipped
    assert len(score_nets._digests) == 5  # each file hashed once, not per shard or call

    state = {k: v + 0.5 for k, v in twin.aesthetic.state_dict().items()}
    save(state, tmp_path / "aes.pth")  # new weights, same file name, same scorer name
    new_identity = score.scorer_identity(spec)
    assert new_identity["weights"]["aesthetic"] != identity["weights"]["aesthetic"]
    assert not score.shard_done(root, "src", "00000", new_identity)
    assert score.shard_done(root, "src", "00000", identity)
    again = score.score_shard(root, "src", "00000", spec, device="cpu")
    assert not again.skipped and again.extra["scorer_identity"] == new_identity
    after = pq.read_table(out)["aesthetic"].to_numpy()
    assert not np.allclose(after, before)
    assert score.shard_done(root, "src", "00000", new_identity)

    # Random twins: keyed by their settings, not by a file.
    random = score.scorer_identity(tiny)
    assert random["weights"] == "random"
    other = dataclasses.replace(tiny, watermark_side=tiny.watermark_side * 2)
    assert score.scorer_identity(other)["config"] != random["config"]
    assert score.scorer_identity(dataclasses.replace(tiny, batch_size=3)) == random
