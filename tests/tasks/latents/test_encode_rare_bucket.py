"""Issue 33, item 6: a bucket's unfinished batch waits for later shards' images for a bounded
number of batches only, so one image in a rare bucket does not hold back the record of its shard
(and of every later one: shards complete in order) until the stream ends."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from catalog import load_catalog
from catalog.loader import PACKAGED_DIR
from tasks.latents import encode, encode_pipeline, latent_keys
from tests.tasks.latents.test_encode import SOURCE, texture, write_shard
from tests.tasks.latents.test_encode_buckets import PLAN, image_bytes


def test_a_rare_buckets_image_holds_its_shards_record_a_bounded_number_of_batches(
    tmp_path, monkeypatch
):
    flush_after, batch_size = 2, 2
    # A short read-ahead, so what the bound allows is small beside the stream.
    monkeypatch.setattr(encode_pipeline, "DECODE_AHEAD", 4)
    # After shard 0's last image is read, its record waits at most `flush_after` batches (a
    # shard each here), then the batches queued for the VAE and those it encodes at once (one
    # per CPU lane), and a shard or two in the read-ahead and the decoders.
    bound = 1 + flush_after + max(2, 4 // batch_size) + torch.get_num_threads() + 1 + 4
    num_shards = bound + 8
    rng = np.random.default_rng(3)
    pano = image_bytes(texture(rng, 128, 60), "PNG")  # the only image of bucket 80x48
    squares = [image_bytes(texture(rng, 64, 64), "PNG") for _ in range(2)]
    write_shard(tmp_path, {"pano": pano}, ["pano"], "00000")
    shards = [f"{i:05d}" for i in range(num_shards)]
    for shard in shards[1:]:  # a full 64x64 batch each
        write_shard(tmp_path, {"a": squares[0], "b": squares[1]}, ["a", "b"], shard)
    model = dataclasses.replace(load_catalog(PACKAGED_DIR).model("tiny"), buckets=PLAN)
    spec = encode.LatentSpec.of(model)
    # The rare image encoded alone (and the encoder warmed up: the stream's timing is its own).
    alone = tmp_path / "alone"
    write_shard(alone, {"pano": pano}, ["pano"], "00000")
    encode.encode_shard(alone, SOURCE, "00000", model, batch_size=2, spec=spec, num_workers=1)
    pulled = []

    def given():
        for shard in shards:
            pulled.append(shard)
            yield shard

    stream = encode.encode_stream(
        tmp_path, SOURCE, given(), model, batch_size=batch_size, spec=spec,
        num_workers=1, flush_after=flush_after,
    )  # fmt: skip
    with contextlib.closing(stream):
        shard, first = next(stream)
        read_before_record = len(pulled)
        rest = [s for s, _ in stream]
    assert shard == "00000" and first.num_out == 1 and first.extra["buckets"] == {"80x48": 1}
    assert rest == shards[1:]
    assert read_before_record <= bound, f"{read_before_record} of {num_shards} shards read"
    table = latent_keys.read(tmp_path, SOURCE, "00000")
    assert table["bucket"].to_pylist() == ["80x48"]
    # The flushed part-batch's latents are those of the image encoded alone (above).
    np.testing.assert_array_equal(
        np.load(latent_keys.latents_path(tmp_path, SOURCE, "00000", "80x48")),
        np.load(latent_keys.latents_path(alone, SOURCE, "00000", "80x48")),
    )


def test_the_wait_is_a_setting_of_at_least_one_batch(monkeypatch):
    assert encode.flush_after_setting() == encode.FLUSH_AFTER
    monkeypatch.setenv("SDPIPE_ENCODE_FLUSH_AFTER", "8")
    assert encode.flush_after_setting() == 8 and encode.flush_after_setting(3) == 3
    with pytest.raises(ValueError, match="flush_after 0"):
        encode.flush_after_setting(0)
