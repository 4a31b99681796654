"""score's CPU side in decode processes (tasks/curation/score_decode.py): the same bits as the
thread path, drops counted alike, a crashing image dropped alone, nothing left behind."""

from __future__ import annotations

import io
import os
import sys
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from tasks.curation import score, score_decode, score_slots
from tasks.latents import images as image_mod
from tasks.runtime.node import local_node
from tasks.sources import demo_source

FIELDS = ("aesthetic", "similarity", "pwatermark", "punsafe", "phash", "embedding")

# A score worker that takes 0.2 s a chunk (the tests see chunks in flight) and dies, as a decoder
# crash would, on the bytes b"crash".
TESTING = (
    sys.executable,
    "-c",
    "import os, time, tasks.curation.score_decode as m\n"
    "def prepare(items, size, **kw):\n"
    "    if any(data == b'crash' for _, _, data in items):\n"
    "        os._exit(139)\n"
    "    time.sleep(0.2)\n"
    "    return m.prepare_rows(items, size, **kw)\n"
    "m.images.WORKER_TASKS['score'] = prepare\n"
    "m.images.serve()\n",
)


@pytest.fixture(scope="module")
def scorer():
    return score.Scorer(load_catalog(PACKAGED_DIR).scorer("tiny-scoring"), torch.device("cpu"))


@pytest.fixture(scope="module")
def testing_pool():
    pool = image_mod.DecodePool(1, TESTING)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool():
    # The process's kept pool of 2, as the stage takes it with SDPIPE_WORKERS=2 (each worker
    # imports open_clip: seconds on 2 cores, paid once for the file).
    return score_decode.decode_pool(local_node(2))


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def awkward_images(n: int) -> tuple[list[bytes], list[str]]:
    """JPEGs of several sizes and aspect ratios, and the awkward ones of real shards: a PNG
    with alpha, a palette GIF, grayscale, CMYK, 16-bit PNG, a cut-off JPEG, bytes of nothing."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        w, h = 40 + 13 * (i % 7), 36 + 29 * (i % 3)
        img, _ = demo_source.draw_scene(rng, w, h)
        out.append(encoded(img, "JPEG"))
    scene, _ = demo_source.draw_scene(rng, 64, 48)
    rgba = scene.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((64, 48)))
    out[1] = encoded(rgba, "PNG")
    out[2] = encoded(scene.convert("P"), "GIF")
    out[4] = encoded(scene.convert("L"), "JPEG")
    out[5] = encoded(scene.convert("CMYK"), "JPEG")
    out[6] = encoded(Image.fromarray(np.full((30, 50), 40000, np.uint16)), "PNG")
    out[7] = out[0][: len(out[0]) // 2]
    out[9] = b"not an image"
    captions = [f"scene {i}" if i % 4 else "" for i in range(n)]
    return out, captions


def test_processes_score_the_threads_bits(scorer, pool):
    # Same input bits, same networks: the scores, pHashes and drops of the thread path, bit
    # for bit, at any batch split and chunk size (a chunk spanning batches, a chunk of one).
    images, captions = awkward_images(23)
    for batch_size, chunk in ((4, 3), (32, 8), (5, 1)):
        kw = dict(batch_size=batch_size, workers=2)
        expected = score.score_images(scorer, images, captions, **kw)
        assert expected[2] == {7: "decode_error", 9: "decode_error"}
        rows, got, dropped = score.score_images(
            scorer, images, captions, **kw, pool=pool, chunk=chunk
        )
        assert rows == expected[0] and dropped == expected[2]
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(got, name), getattr(expected[1], name), name)


def test_a_crashing_image_is_dropped_alone(scorer, testing_pool, monkeypatch):
    # Mid-chunk: its worker dies, the chunk's images are retried one at a time on one new
    # worker, replaced once more after the crashing image, and that survivor takes the next
    # chunk (each start imports open_clip: seconds).
    images, captions = awkward_images(10)
    images[5] = b"crash"
    score.score_images(scorer, images[:1], captions[:1], batch_size=4, workers=1, pool=testing_pool)
    starts = []
    start = testing_pool._start
    monkeypatch.setattr(testing_pool, "_start", lambda: starts.append(1) or start())
    rows, got, dropped = score.score_images(
        scorer, images, captions, batch_size=4, workers=1, pool=testing_pool, chunk=4
    )
    assert dropped == {5: "decoder_crash", 7: "decode_error", 9: "decode_error"}
    assert rows == [i for i in range(10) if i not in (5, 7, 9)]
    assert len(starts) == 2
    alone = [images[i] for i in rows]
    expected = score.score_images(
        scorer, alone, [captions[i] for i in rows], batch_size=4, workers=1
    )
    np.testing.assert_array_equal(got.embedding, expected[1].embedding)
    np.testing.assert_array_equal(got.phash, expected[1].phash)


def test_a_chunk_that_cannot_reach_the_slots_fails_its_shard_not_its_worker(scorer, pool):
    # Memory a worker cannot open (another PID namespace's /proc, a parent that is not
    # dumpable) or that is not the shard's any more: the chunk fails with the worker's error,
    # naming the way out, at once; the workers stay (no retry image by image).
    workers = score_workers()
    slots = score_slots.Slots(scorer, 4, shared=True)
    memory = slots.memory
    request = dict(steps=scorer.pil_tfs, layout=memory.layout, identity=memory.identity)
    items = [(0, 0, awkward_images(10)[0][0])]
    try:
        gone = pool.submit(items, 0, "score", memory="/proc/self/fd/999999", **request)
        with pytest.raises(image_mod.WorkerError, match="SDPIPE_SCORE_DECODE=threads"):
            gone.result()
        other = dict(request, identity=(0, 0))
        stale = pool.submit(items, 0, "score", memory=memory.path, **other)
        with pytest.raises(image_mod.WorkerError, match="no longer the shard's shared slots"):
            stale.result()
        assert pool.submit(items, 0, "score", memory=memory.path, **request).result()[0] == [0]
    finally:
        slots.close()
    assert score_workers() == workers


def test_shared_slots_are_gone_with_the_shard(scorer, pool):
    # The slots' memfd is closed when the shard is done: no process can open it any more and
    # nothing is left in /dev/shm by a run, finished or killed.
    slots = score_slots.Slots(scorer, 4, shared=True)
    path = slots.memory.path
    assert os.path.exists(path)
    slots.close()
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="fast path"):
        fp32 = score.Scorer(scorer.spec, torch.device("cpu"), fast=False)
        score_slots.Slots(fp32, 4, shared=True)


def test_score_shard_in_processes_records_what_threads_do(scorer, pool, tmp_path, monkeypatch):
    # The stage itself, decode processes asked for (the default on CUDA's fast path): its
    # scores file equals the thread path's, drops counted under the same reasons.
    images, captions = awkward_images(12)
    shards = tmp_path / "web" / "shards"
    shards.mkdir(parents=True)
    rows = []
    with tarfile.open(shards / "00000.tar", "w") as tar:
        for i, data in enumerate(images):
            info = tarfile.TarInfo(f"k{i:03d}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            rows.append({"key": f"k{i:03d}", "caption": captions[i], "status": "success"})
    rows.append({"key": "k999", "caption": "", "status": "success"})  # not in the tar
    pq.write_table(pa.Table.from_pylist(rows), shards / "00000.parquet")
    spec = scorer.spec
    monkeypatch.setenv("SDPIPE_WORKERS", "2")
    made = {}
    for processes in (False, True):
        root = tmp_path / f"p{int(processes)}"
        (root / "web").mkdir(parents=True)
        (root / "web" / "shards").symlink_to(shards)
        stats = score.score_shard(root, "web", "00000", spec, device="cpu", processes=processes)
        made[processes] = (stats, pq.read_table(root / "web" / "scores" / "00000.parquet"))
    (threads, expected), (procs, got) = made[False], made[True]
    assert got.equals(expected)
    assert procs.dropped == threads.dropped == {"missing_image": 1, "decode_error": 2}
    assert (procs.num_in, procs.num_out) == (threads.num_in, threads.num_out) == (13, 10)
    assert score_decode.decode_pool(local_node(2)) is pool  # the node's budget's pool, kept


@pytest.mark.gpu
def test_cuda_default_decodes_in_processes_with_the_threads_results(tmp_path):
    # On CUDA's fast path the stage decodes in processes by default: the same rows, drops and
    # pHashes as threads; scores within fp16 noise (cuBLAS may split sums differently).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cuda = score.Scorer(load_catalog(PACKAGED_DIR).scorer("tiny-scoring"), torch.device("cuda"))
    images, captions = awkward_images(40)
    kw = dict(batch_size=8, workers=2)
    expected = score.score_images(cuda, images, captions, **kw)
    pool = score_decode.decode_pool(local_node(2))
    rows, got, dropped = score.score_images(cuda, images, captions, **kw, pool=pool)
    assert rows == expected[0] and dropped == expected[2]
    np.testing.assert_array_equal(got.phash, expected[1].phash)
    for name in ("aesthetic", "similarity", "pwatermark", "punsafe"):
        np.testing.assert_allclose(getattr(got, name), getattr(expected[1], name), atol=1e-3)


def test_a_failed_shard_leaves_the_pool_as_it_was(scorer, testing_pool, monkeypatch):
    # The networks fail at the first batch with chunks still queued and one running: the error
    # comes through, queued chunks are cancelled and the running one awaited before the slots'
    # memory closes, so no worker meets closed memory (each would die and the pool start new
    # ones, ~4 s each, for every image of every chunk left).
    images, captions = awkward_images(16)
    kw = dict(batch_size=4, workers=1, pool=testing_pool, chunk=2)
    score.score_images(scorer, images[:2], captions[:2], **kw)
    workers = score_workers()
    calls = []

    def failing(slots, slot_ids, captions):
        calls.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with monkeypatch.context() as patch:
        patch.setattr(scorer, "submit", failing)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            score.score_images(scorer, images, captions, **kw)
    assert len(calls) == 1
    rows, got, dropped = score.score_images(scorer, images, captions, **kw)
    assert len(rows) + len(dropped) == 16
    assert score_workers() == workers


def test_closed_decoders_leave_no_chunk_to_write_into_the_slots(scorer, testing_pool):
    # A memfd's number is reused by the next shard's: a chunk still queued or running when its
    # shard's slots close would write into another shard's slots. close() cancels the queued
    # ones and waits for the running one.
    images, _ = awkward_images(12)
    slots = score_slots.Slots(scorer, 12, shared=True)
    decoders = score_slots.Decoders(scorer, slots, 1, testing_pool, chunk=2)
    for i, data in enumerate(images):
        decoders.decode(i, slots.free.pop(), data)
    decoders.flush()
    chunks = {id(f): f for f in decoders.futures.values()}.values()
    assert len(chunks) == 6 and not all(f.done() for f in chunks)
    decoders.close()
    slots.close()
    assert all(f.done() for f in chunks)  # finished, or cancelled before a worker took it
    assert any(f.cancelled() for f in chunks)


def score_workers() -> set[int]:
    """The pids of this process's score decode workers."""
    import psutil

    return {p.pid for p in psutil.Process().children() if "score_decode" in " ".join(p.cmdline())}


def test_where_score_decodes_by_default(monkeypatch):
    # Processes on CUDA's fast path, threads elsewhere; SDPIPE_SCORE_DECODE decides where set
    # (the way out where processes cannot share the slots), never processes for the old path.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(score.DECODE_ENV, raising=False)
    assert score.decode_in_processes(True, cuda) and not score.decode_in_processes(True, cpu)
    assert not score.decode_in_processes(False, cuda)
    monkeypatch.setenv(score.DECODE_ENV, "threads")
    assert not score.decode_in_processes(True, cuda)
    monkeypatch.setenv(score.DECODE_ENV, "processes")
    assert score.decode_in_processes(True, cpu) and not score.decode_in_processes(False, cpu)
    monkeypatch.setenv(score.DECODE_ENV, "thread")
    with pytest.raises(ValueError, match="SDPIPE_SCORE_DECODE='thread'"):
        score.decode_in_processes(True, cpu)
