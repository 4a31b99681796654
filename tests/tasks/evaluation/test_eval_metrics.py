"""The eval's metrics equal independent reference computations on fixed images: FID as pytorch-fid
computes it (its network loaded from the same weights file and its preprocessing give the same
features; its sqrtm formula gives the same distance for the same features: sqrtm is checked on
32-d features, where it is accurate and fast, not on 2048-d ones of a few images, where it takes
20 s and warns it is inaccurate), CLIP score by torchmetrics' definition with open_clip used
image by image, and the nearest training image by brute force."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from catalog import load_catalog
from tasks.curation.score import Scorer
from tasks.evaluation import eval_metrics, fid
from tests.tasks.conftest import scene_jpeg

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


def scenes(seeds, side=96) -> list[Image.Image]:
    return [Image.open(io.BytesIO(scene_jpeg(s, side=side))).convert("RGB") for s in seeds]


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    """A weights file in the layout of pt_inception-2015-12-05-6726825d.pth (random values)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        state = fid.fid_inception(init_weights=True).state_dict()
    path = tmp_path_factory.mktemp("weights") / "fid" / "pt_inception.pth"
    path.parent.mkdir()
    torch.save(state, path)
    return path


def test_fid_features_equal_pytorch_fid(weights_file, monkeypatch):
    pytest.importorskip("pytorch_fid")
    import pytorch_fid.inception as reference
    from torchvision.transforms.functional import to_tensor

    state = torch.load(weights_file, weights_only=True)
    monkeypatch.setattr(reference, "load_state_dict_from_url", lambda *a, **k: state)
    ref_net = reference.InceptionV3([reference.InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).eval()
    ours = fid.FIDFeatures(str(weights_file), CPU)  # loads the file strictly, as the real one

    generated, held_out = scenes(range(3), side=64), scenes(range(50, 52), side=128)
    mine = [ours(generated), ours(held_out)]
    with torch.no_grad():
        theirs = [
            ref_net(torch.stack([to_tensor(im) for im in images]))[0].flatten(1).double().numpy()
            for images in (generated, held_out)
        ]
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    a, b = fid.Moments.empty(), fid.Moments.empty()
    a.add(mine[0][:1])
    a.add(mine[0][1:])  # streamed in two batches
    b.add(mine[1])
    np.testing.assert_allclose(a.mean_cov()[1], np.cov(theirs[0], rowvar=False), atol=1e-15)
    assert fid.fid(a, b) > 0


def test_fid_features_of_mixed_sizes_are_each_image_alone(weights_file, monkeypatch):
    """A batch of images of different sizes (a reference folder mixing sizes, held-out images
    smaller than the model side, banners wider than 4:1) is resized image by image, each as
    pytorch-fid resizes a batch of one."""
    pytest.importorskip("pytorch_fid")
    import pytorch_fid.inception as reference
    from torchvision.transforms.functional import to_tensor

    state = torch.load(weights_file, weights_only=True)
    monkeypatch.setattr(reference, "load_state_dict_from_url", lambda *a, **k: state)
    ref_net = reference.InceptionV3([reference.InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).eval()
    ours = fid.FIDFeatures(str(weights_file), CPU)
    banner = scenes([9], side=96)[0].resize((500, 96))  # wider than 4:1
    images = [*scenes([1], side=64), *scenes([2], side=128), banner]
    images.append(fid.center_square(banner))
    mine = ours(images)
    with torch.no_grad():
        theirs = np.concatenate(
            [ref_net(to_tensor(im)[None])[0].flatten(1).double().numpy() for im in images]
        )
    assert mine.shape == (4, fid.DIM)
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-7)


def test_a_reference_folder_of_mixed_sizes_gives_moments(weights_file, tmp_path):
    """COCO val mixes sizes: each image's centered square, resized alone, in one batch."""
    from types import SimpleNamespace

    from tasks.evaluation import evaluate

    folder = tmp_path / "reference"
    folder.mkdir()
    images = [*scenes([1], side=64), *scenes([2], side=128), scenes([3])[0].resize((500, 96))]
    for i, im in enumerate(images):
        im.save(folder / f"{i}.png")
    features = fid.FIDFeatures(str(weights_file), CPU)
    spec = SimpleNamespace(fid_weights=str(weights_file), fid_random_weights=False)
    moments = evaluate.reference_moments(tmp_path, folder, features, spec, log=lambda _: None)
    expected = fid.Moments.empty()
    for im in images:
        expected.add(features([fid.center_square(im)]))
    assert moments.count == 3
    np.testing.assert_allclose(moments.total, expected.total, rtol=1e-6)


def test_frechet_distance_equals_pytorch_fid_full_rank_and_singular():
    pytest.importorskip("pytorch_fid")
    from pytorch_fid.fid_score import calculate_frechet_distance

    def by_hand(x, y):
        stats = [(z.mean(0), np.cov(z, rowvar=False)) for z in (x, y)]
        return calculate_frechet_distance(*stats[0], *stats[1])

    rng = np.random.default_rng(0)
    for n1, n2, dim in ((400, 300, 32), (12, 300, 32), (300, 9, 32)):
        x = rng.standard_normal((n1, dim))
        y = 1.3 * rng.standard_normal((n2, dim)) + 0.2
        a, b = fid.Moments.empty(dim), fid.Moments.empty(dim)
        a.add(x)
        b.add(y)
        assert a.mean_cov()[1] == pytest.approx(np.cov(x, rowvar=False), abs=1e-12)
        assert fid.fid(a, b) == pytest.approx(by_hand(x, y), rel=1e-6)
        assert fid.frechet_distance(*a.mean_cov(), *b.mean_cov()) == pytest.approx(
            by_hand(x, y), rel=1e-6
        )
    same = fid.Moments.empty(dim)
    same.add(x)
    assert abs(fid.fid(same, a)) < 1e-6 * by_hand(x, y)


def test_fid_weights_missing_or_wrong_fail_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SDPIPE_WEIGHTS", str(tmp_path))
    with pytest.raises(fid.FIDWeightsError, match="pt_inception-2015-12-05-6726825d.pth"):
        fid.FIDFeatures("fid/missing.pth", CPU)
    torch.save({"fc.weight": torch.zeros(3)}, tmp_path / "wrong.pth")
    with pytest.raises(fid.FIDWeightsError, match="not the FID Inception's weights"):
        fid.FIDFeatures("wrong.pth", CPU)


@pytest.fixture(scope="module")
def scorer():
    return Scorer(load_catalog().scorer("tiny-scoring"), CPU)


def test_clip_score_and_aesthetic_equal_a_hand_computation(scorer):
    import open_clip

    images = scenes(range(6))
    prompts = [f"a scene with {w}" for w in ("a circle", "a square", "snow", "sand", "sky", "x")]
    got = eval_metrics.score_images(scorer, images, prompts, batch_size=4)
    model = scorer.embed
    preprocess = open_clip.image_transform(
        model.visual.image_size,
        is_train=False,
        mean=open_clip.OPENAI_DATASET_MEAN,
        std=open_clip.OPENAI_DATASET_STD,
    )
    tokenizer = open_clip.get_tokenizer("ViT-L-14")
    for i, (image, prompt) in enumerate(zip(images, prompts, strict=True)):
        with torch.no_grad():
            e_i = model.encode_image(preprocess(image)[None]).double()[0]
            e_c = model.encode_text(tokenizer([prompt])).double()[0]
            cosine = float(e_i @ e_c / (e_i.norm() * e_c.norm()))
            aesthetic = float(scorer.aesthetic((e_i / e_i.norm()).float()[None]))
        assert got.cosine[i] == pytest.approx(cosine, abs=1e-5)
        assert eval_metrics.clip_score(got.cosine)[i] == pytest.approx(
            max(100 * cosine, 0), abs=1e-3
        )  # torchmetrics' CLIPScore: max(100 cos, 0)
        assert got.aesthetic[i] == pytest.approx(aesthetic, abs=1e-5)
    assert len(set(np.round(got.cosine, 6))) > 1  # the prompts make a difference


def test_nearest_training_image_equals_brute_force():
    rng = np.random.default_rng(1)
    generated = rng.standard_normal((7, 16)).astype(np.float32)
    train = rng.standard_normal((50, 16)).astype(np.float16)
    train[23] = generated[4]  # a copy
    blocks = [
        eval_metrics.Block("s", f"{i:05d}", [f"k{j}" for j in range(i * 10, i * 10 + 10)],
                           train[i * 10 : i * 10 + 10], computed=False)
        for i in range(5)
    ]  # fmt: skip
    got = eval_metrics.nearest_training(generated, iter(blocks), CPU)
    g = generated / np.linalg.norm(generated, axis=1, keepdims=True)
    t = train.astype(np.float64) / np.linalg.norm(train.astype(np.float64), axis=1, keepdims=True)
    sims = g @ t.T
    assert got.key == [f"k{j}" for j in sims.argmax(1)]
    np.testing.assert_allclose(got.similarity, sims.max(1), atol=1e-5)
    assert got.key[4] == "k23" and got.similarity[4] > 0.9999
    assert got.shard[4] == "00002"


def test_one_scan_for_several_candidates_equals_a_scan_of_each():
    rng = np.random.default_rng(2)
    candidates = [rng.standard_normal((n, 16)).astype(np.float32) for n in (7, 3, 0, 5)]
    train = rng.standard_normal((60, 16)).astype(np.float16)
    train[41] = candidates[1][2]  # a copy of one candidate's generation
    train[7] = candidates[3][0]
    reads = []

    def blocks():
        for i in range(6):
            reads.append(i)
            keys = [f"k{j}" for j in range(i * 10, i * 10 + 10)]
            yield eval_metrics.Block("s", f"{i:05d}", keys, train[i * 10 : i * 10 + 10], False)

    alone = [eval_metrics.nearest_training(g, blocks(), CPU, query_rows=2) for g in candidates]
    reads.clear()
    together = eval_metrics.nearest_training_many(candidates, blocks(), CPU, query_rows=2)
    assert reads == list(range(6))  # the training rows read once for all candidates
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a.similarity, b.similarity)  # the same numbers
        assert (a.source, a.shard, a.key) == (b.source, b.shard, b.key)
    assert together[1].key[2] == "k41" and together[3].key[0] == "k7"
    assert len(together[2].similarity) == 0
