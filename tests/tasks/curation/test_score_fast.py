"""The score stage's fast path: the CPU makes uint8 pixels with the PIL steps of LAION's
transforms, the device normalizes them per batch. Its network inputs are the same bits as the
old path's (torchvision's ToTensor + Normalize per image), so on the CPU (fp32 weights both
ways) its scores are the old path's, bit for bit. On CUDA it runs fp16 weights: within a
stated tolerance of the fp32 reference (`gpu`-marked)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from catalog.schema import ScoringModel
from tasks.curation import score, score_slots
from tasks.sources import demo_source

FIELDS = ("aesthetic", "similarity", "pwatermark", "punsafe", "phash", "embedding")


@pytest.fixture(scope="module")
def tiny() -> ScoringModel:
    return load_catalog(PACKAGED_DIR).scorer("tiny-scoring")


def jpeg(seed: int, side: int, grain: bool = False) -> bytes:
    rng = np.random.default_rng(seed)
    img, _ = demo_source.draw_scene(rng, side, side)
    if grain:  # photo-like noise: every pixel value, not flat areas
        pixels = np.asarray(img, np.float64) + rng.normal(0, 8, (side, side, 3))
        img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def images_and_captions(n: int) -> tuple[list[bytes], list[str]]:
    images = [jpeg(i, 48 + 8 * (i % 5), grain=i % 2 == 1) for i in range(n)]
    images[3] = b"not an image"  # dropped by both paths alike
    captions = [f"scene {i}" if i % 4 else "" for i in range(n)]
    return images, captions


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_normalization_is_torchvisions_bit_for_bit(tiny, device):
    # Each transform's PIL steps on the CPU, then /255 and Normalize per batch on the device:
    # the same float32 bits as torchvision's ToTensor + Normalize of each image on the CPU.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    scorer = score.Scorer(tiny, torch.device(device))
    imgs = [
        Image.open(io.BytesIO(jpeg(i, 64 + 16 * i, grain=True))).convert("RGB") for i in range(4)
    ]
    tfs = [scorer.embed_tf, scorer.watermark_tf]
    for which, (tf, pil) in enumerate(
        zip(tfs, [scorer.pil_tfs[0], scorer.pil_tfs[-1]], strict=True)
    ):
        expected = torch.stack([tf(img) for img in imgs])
        pixels = torch.from_numpy(np.stack([np.asarray(pil(img)) for img in imgs]))
        got = scorer.normalize(pixels.to(device), which).cpu()
        assert got.dtype == torch.float32
        assert torch.equal(got.contiguous(), expected)  # bits, not a tolerance


def test_pil_steps_are_the_transforms_own(tiny):
    # Derived from the open_clip / torchvision transform objects, not restated.
    from torchvision import transforms as T

    scorer = score.Scorer(tiny, torch.device("cpu"))
    assert scorer.pil_tfs[0].transforms == scorer.embed_tf.transforms[:-2]
    assert scorer.pil_tfs[-1].transforms == scorer.watermark_tf.transforms[:-2]
    mean, std = scorer.norms[0]
    assert mean.flatten().tolist() == torch.tensor(scorer.embed_tf.transforms[-1].mean).tolist()
    assert std.flatten().tolist() == torch.tensor(scorer.embed_tf.transforms[-1].std).tolist()
    with pytest.raises(ValueError, match="ToTensor and Normalize"):
        score.pil_steps(T.Compose([T.Resize(8), T.ToTensor()]))


def test_fast_path_scores_are_the_old_paths_on_the_cpu(tiny):
    # fp32 weights both ways on the CPU and the same input bits: the same scores, bit for bit
    # (tolerance: none), the same drops, whatever the batch split.
    images, captions = images_and_captions(11)
    old = score.Scorer(tiny, torch.device("cpu"), fast=False)
    new = score.Scorer(tiny, torch.device("cpu"), fast=True)
    for batch_size in (4, 32):
        kw = dict(batch_size=batch_size, workers=2)
        rows_old, expected, dropped_old = score.score_images(old, images, captions, **kw)
        rows_new, got, dropped_new = score.score_images(new, images, captions, **kw)
        assert rows_new == rows_old and len(rows_new) == 10
        assert dropped_new == dropped_old == {3: "decode_error"}
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), name)
            assert getattr(got, name).dtype == getattr(expected, name).dtype


def test_fast_slots_hold_uint8_pixels(tiny):
    scorer = score.Scorer(tiny, torch.device("cpu"))
    slots = score_slots.Slots(scorer, 3)
    side = tiny.watermark_side
    assert [(b.dtype, tuple(b.shape)) for b in slots.inputs] == [
        (torch.uint8, (3, 32, 32, 3)),
        (torch.uint8, (3, side, side, 3)),
    ]
    old = score_slots.Slots(score.Scorer(tiny, torch.device("cpu"), fast=False), 3)
    assert [b.dtype for b in old.inputs] == [torch.float32, torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp16_cuda_scores_are_within_tolerance_of_fp32():
    # The real architectures (random weights) in fp16 weights on CUDA against the same
    # networks in fp32 on CUDA (no autocast, TF32 off): the scores within the stated tolerance.
    spec = ScoringModel(name="full-random-test", kind="scoring", random_weights=True)
    images = [jpeg(i, 512, grain=True) for i in range(24)]
    captions = [f"a photo of scene {i}" for i in range(24)]
    cuda = torch.device("cuda")
    fast = score.Scorer(spec, cuda, fast=True)
    reference = score.Scorer(spec, cuda, fast=True)
    reference.half = False
    for net in (reference.embed, reference.similarity, reference.watermark):
        net.float()
    reference.watermark.to(memory_format=torch.contiguous_format)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        kw = dict(batch_size=8, workers=4)
        _, want, _ = score.score_images(reference, images, captions, **kw)
        _, got, _ = score.score_images(fast, images, captions, **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    np.testing.assert_array_equal(got.phash, want.phash)
    # Tolerances: probabilities and cosines to 1e-2 absolute; the aesthetic score (a linear
    # read-out of the embedding, ~unit scale with random weights) to 2e-2 absolute; the
    # embedding's cosine to its fp32 self >= 0.999.
    np.testing.assert_allclose(got.similarity, want.similarity, atol=1e-2)
    np.testing.assert_allclose(got.pwatermark, want.pwatermark, atol=1e-2)
    np.testing.assert_allclose(got.punsafe, want.punsafe, atol=1e-2)
    np.testing.assert_allclose(got.aesthetic, want.aesthetic, atol=2e-2)
    a, b = got.embedding.astype(np.float32), want.embedding.astype(np.float32)
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cosine.min() >= 0.999, cosine.min()
